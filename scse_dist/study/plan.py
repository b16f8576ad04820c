"""A study on disk: the layout the runners write and the report reads, run status, LR choice.

    <out>/<study>/study.yaml        the resolved spec (variants expanded, base path resolved)
    <out>/<study>/runs.json         [{"variant", "seed", "lr", "stage", "run_dir", "config",
                                      "overrides"}, ...]: every run known so far
    <out>/<study>/lr_choice.json    {variant: {"lr", "key" (the field it sets),
                                               "scores": {lr: loss}, "failed": [...], ...}}
    <out>/<study>/<variant>/<variant>-seed<k>/             a final run (stage 2)
    <out>/<study>/<variant>/<variant>-lr<value>-seed<k>/   an LR sweep run (stage 1)

Each run dir (scse_dist.run_dir) holds its resolved config.yaml, written before training, and
the trainer's outputs. A run is done when its export and every evaluation of its stage (a sweep
run's: eval/validation.json) are complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from scse_dist.atomic import atomic_write_text
from scse_dist.config import config_to_dict
from scse_dist.config_paths import input_exists, input_paths
from scse_dist.run_dir import VALIDATION_NAME, RunDir, is_complete
from scse_dist.study.runs import Run, expand, run_config
from scse_dist.study.spec import StudySpec

SPEC_NAME, RUNS_NAME, LR_CHOICE_NAME = "study.yaml", "runs.json", "lr_choice.json"


class StudyError(RuntimeError):
    """The study cannot go on (e.g. every LR sweep run of a variant failed)."""


def status(spec: StudySpec, run: Run) -> str:
    """done (export and complete evaluations), partial (something was started), or new."""
    d = RunDir(run.run_dir)
    evals = [VALIDATION_NAME] if run.stage == "sweep" else spec.evals.tasks
    if d.exported() and all(d.evaluated(name) for name in evals):
        return "done"
    return "partial" if d.started() else "new"


def read_choice(spec: StudySpec) -> dict[str, float] | None:
    path = spec.study_dir / LR_CHOICE_NAME
    if not spec.lr or not path.is_file():
        return None
    return {v: c["lr"] for v, c in json.loads(path.read_text()).items()}


def write_study(spec: StudySpec, stage: str) -> list[Run]:
    """Write study.yaml, each run's config.yaml and runs.json up to `stage`; the stage's runs."""
    chosen = read_choice(spec)
    d = spec.study_dir
    d.mkdir(parents=True, exist_ok=True)
    resolved = dataclasses.asdict(spec)
    resolved["pairs"] = [list(p) for p in spec.pairs]
    atomic_write_text(d / SPEC_NAME, yaml.safe_dump(resolved, sort_keys=False))
    known = expand(spec, chosen, ("sweep",) if stage == "sweep" else ("sweep", "final"))
    for run in known:
        cfg = run_config(spec, run)
        Path(run.run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    atomic_write_text(d / RUNS_NAME, json.dumps([r.record() for r in known], indent=2) + "\n")
    return [r for r in known if r.stage == stage]


def evaluate_validation(spec: StudySpec, run: Run) -> float | None:
    """The sweep score of a run: loss on `lr.validation` at the training depth (None: no export),
    computed once into eval/validation.json."""
    d = RunDir(run.run_dir)
    out = d.results(VALIDATION_NAME)
    if not is_complete(out):
        if not d.exported():
            return None
        from scse_dist.eval.export_eval import evaluate_export

        assert spec.lr is not None  # sweep runs exist only with lr:
        evaluate_export(d, "heldout", data=spec.lr.validation, at_model_depth=True,
                        name=VALIDATION_NAME, label=f"{run.run_dir}@export (validation)")
    loss = json.loads(out.read_text())["results"][0]["loss"]
    return loss if loss is not None else float("inf")  # a diverged run loses the choice


def choose_lrs(spec: StudySpec) -> dict[str, float]:
    """Each variant's rate, the lowest validation loss of its sweep, into lr_choice.json;
    StudyError when a variant has no sweep run that finished."""
    assert spec.lr is not None  # called only for a study with lr:
    choice: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    for variant in spec.variants:
        runs = [r for r in expand(spec, None, ("sweep",)) if r.variant == variant]
        scores = {r.lr: evaluate_validation(spec, r) for r in runs}
        done = {lr: s for lr, s in scores.items() if s is not None}
        if not done:
            missing.append(variant)
            continue
        best = min(done, key=lambda lr: done[lr])
        choice[variant] = {"lr": best, "key": spec.rate_key(variant),
                           "scores": {f"{lr:g}": s for lr, s in scores.items()},
                           "failed": [r.run_dir for r in runs if scores[r.lr] is None],
                           "metric": "loss on lr.validation at model.depth",
                           "validation": spec.lr.validation}
    if missing:
        raise StudyError(f"no LR sweep run finished for variant(s) {', '.join(missing)}; see "
                         f"{spec.study_dir}/<variant>/lr*/ and rerun the study")
    atomic_write_text(spec.study_dir / LR_CHOICE_NAME, json.dumps(choice, indent=2) + "\n")
    return {v: c["lr"] for v, c in choice.items()}


def _inputs(spec: StudySpec, run: Run) -> dict[str, str]:
    """field -> the local path a run reads: its config's (config_paths.input_paths), the test
    tasks' files for final runs only, lr.validation for sweep runs."""
    found = input_paths(run_config(spec, run))
    if run.stage == "sweep":
        assert spec.lr is not None  # sweep runs exist only with lr:
        found = {k: v for k, v in found.items() if not k.startswith("eval.")}
        if "://" not in spec.lr.validation:
            found["lr.validation"] = spec.lr.validation
    return found


def _which(needing: list[Run], runs: list[Run]) -> str:
    """'all 54 runs', 'all 27 sweep runs', or '3 run(s): a, b, c' (the first 4 named)."""
    if len(needing) == len(runs):
        return f"all {len(runs)} runs"
    stages = {r.stage for r in needing}
    if len(stages) == 1 and len(needing) == sum(r.stage in stages for r in runs):
        return f"all {len(needing)} {stages.pop()} runs"
    names = [Path(r.run_dir).name for r in needing]
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"{len(names)} run(s): {', '.join(names[:4])}{more}"


def missing_inputs(spec: StudySpec) -> list[str]:
    """One line per missing input file, naming the field and the runs that need it."""
    runs = expand(spec, read_choice(spec))
    needed: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        for key, path in _inputs(spec, run).items():
            if not input_exists(path):
                needed.setdefault((key, path), []).append(run)
    return [f"missing input: {key} {path} (no such file or directory), needed by "
            f"{_which(needing, runs)}"
            for (key, path), needing in needed.items()]


def refused_data(spec: StudySpec) -> list[tuple[int, str]]:
    """(exit status, line naming the runs) for each data setup the runs' own start-up check
    (scse_dist.data.preflight.check_run_data) would refuse; after missing_inputs found none."""
    from scse_dist.cli_errors import exit_status, one_line
    from scse_dist.data.preflight import check_run_data

    runs = expand(spec, read_choice(spec))
    verdicts: dict[tuple, tuple[int, str] | None] = {}
    needing: dict[tuple[int, str], list[Run]] = {}
    for run in runs:
        cfg = run_config(spec, run)
        d = cfg.data
        key = (d.path, d.tokenizer, d.tokenizer_kind, d.build, d.build_vocab_size,
               cfg.model.vocab_size)
        if key not in verdicts:
            verdicts[key] = None
            try:
                check_run_data(cfg)
            except Exception as exc:
                status = exit_status(exc)
                if status is None:
                    raise
                verdicts[key] = (status, one_line(exc))
        verdict = verdicts[key]
        if verdict is not None:
            needing.setdefault(verdict, []).append(run)
    return [(status, f"{line} (exit {status}), for {_which(failing, runs)}")
            for (status, line), failing in needing.items()]

