"""A study's validation stage: every choice (a sweep's rate, the report's validation table and
pre-registered comparisons on it) is made on one validation text, never on a test set. Each run's
export is scored once into RUN/eval/validation.json (the held-out task on that text): a sweep run
at the depth the rate is chosen at, a final run at the study's evaluation depths.

The spec's `validation: {path, depth}` names the text; without it a sweep scores on
`lr.validation` at the run's model.depth (the rule of the studies before it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from scse_dist.run_dir import VALIDATION_NAME, RunDir, is_complete

if TYPE_CHECKING:
    from scse_dist.study.runs import Run
    from scse_dist.study.spec import StudySpec


def score(run_dir: str | os.PathLike, data: Optional[str], name: str = VALIDATION_NAME,
          depths: Optional[list[int]] = None, at_model_depth: bool = False,
          label: Optional[str] = None) -> Optional[list[dict]]:
    """RUN/eval/<name>.json's rows, evaluated from RUN/export on `data` first when missing (at
    `depths`, else model.depth with at_model_depth, else eval.depths); None when there is nothing
    to read yet (no export, or no data to evaluate on)."""
    d = RunDir(run_dir)
    out = d.results(name)
    if not is_complete(out):
        if data is None or not d.exported():
            return None
        from scse_dist.eval.export_eval import evaluate_export

        with contextlib.redirect_stdout(sys.stderr):  # the evaluation's own table: not ours
            evaluate_export(d, "heldout", data=data, at_model_depth=at_model_depth, depths=depths,
                            name=name, label=label or f"{Path(run_dir).name}@export ({name})")
    return list(json.loads(out.read_text())["results"])


def sweep_metric(spec: StudySpec) -> str:
    """What lr_choice.json says a sweep run was scored by."""
    if spec.validation:
        return f"loss on validation.path at T={spec.validation.depth}"
    return "loss on lr.validation at model.depth"


def sweep_score(spec: StudySpec, run: Run) -> Optional[float]:
    """A sweep run's score, its validation loss at the choosing depth (None: not trained)."""
    assert spec.lr is not None  # sweep runs exist only with lr:
    depths = [spec.validation.depth] if spec.validation else None
    rows = score(run.run_dir, spec.lr.validation, depths=depths, at_model_depth=depths is None,
                 label=f"{run.run_dir}@export (validation)")
    if rows is None:
        return None
    loss = rows[0]["loss"]
    return loss if loss is not None else float("inf")  # a diverged run loses the choice


def score_finished(spec: StudySpec, entries: list[dict]) -> list[str]:
    """The stage: each final run of `entries` (runs.json's) with an export and no validation
    score yet is scored at the study's depths. Returns the run dirs scored."""
    if spec.validation is None:
        return []
    done = []
    for entry in entries:
        run_dir = str(entry["run_dir"])
        if entry.get("stage", "final") != "final" or RunDir(run_dir).evaluated(VALIDATION_NAME):
            continue
        if score(run_dir, spec.validation.path, depths=spec.evals.depths) is not None:
            print(f"scse-study: validation: scored {run_dir}", flush=True)
            done.append(run_dir)
    return done
