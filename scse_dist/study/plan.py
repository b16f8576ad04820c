"""A study on disk: the layout the runners write and the report reads, run status, LR choice.

    <out>/<study>/study.yaml        the resolved spec (variants expanded, base path resolved)
    <out>/<study>/runs.json         [{"variant", "seed", "lr", "stage", "run_dir", "config",
                                      "overrides"}, ...]: every run known so far
    <out>/<study>/lr_choice.json    {variant: {"lr", "key" (the field it sets),
                                               "scores": {lr: loss}, "failed": [...], ...}}
    <out>/<study>/<variant>/<variant>-seed<k>/             a final run (stage 2)
    <out>/<study>/<variant>/<variant>-lr<value>-seed<k>/   an LR sweep run (stage 1)

Each run dir (scse_dist.run_dir) holds its resolved config.yaml, written before training (under
the run dir's lock, scse_dist.run_lock), and the trainer's outputs. A run is done when its
export and every evaluation of its stage (a sweep run's: eval/validation.json) are complete.
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
from scse_dist.run_dir import VALIDATION_NAME, RunDir
from scse_dist.run_lock import held
from scse_dist.study.runs import Run, expand, run_config
from scse_dist.study.spec import StudySpec
from scse_dist.study.validation import sweep_metric, sweep_score

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


def _holds(path: str, text: str) -> bool:
    try:
        return Path(path).read_text() == text
    except OSError:
        return False


def read_choice(spec: StudySpec) -> dict[str, float] | None:
    path = spec.study_dir / LR_CHOICE_NAME
    if not spec.lr or not path.is_file():
        return None
    return {v: c["lr"] for v, c in json.loads(path.read_text()).items()}


def selected(spec: StudySpec, runs: list[Run]) -> list[Run]:
    """The runs of the variants `--variants` names (all without it)."""
    return [r for r in runs if not spec.only or r.variant in spec.only]


def recorded_runs(spec: StudySpec) -> list[dict]:
    """runs.json's entries ([] before the study first wrote it)."""
    path = spec.study_dir / RUNS_NAME
    return json.loads(path.read_text()) if path.is_file() else []


def run_key(run_dir: str) -> tuple[str, ...]:
    """A run's place in its study (VARIANT/RUN), however its path was written: relative to the
    cwd of a submission, or absolute from a stage job that read the spec by its full path."""
    return Path(run_dir).parts[-2:]


def merged_runs(spec: StudySpec, new: list[dict]) -> list[dict]:
    """runs.json's entries with `new` laid over them by run (the newest entry of a run wins),
    in the spec's run order, then any run the spec no longer names, in their old order: a study
    run in pieces records what one run in one go would."""
    by_run = {run_key(r["run_dir"]): r for r in recorded_runs(spec)}
    by_run.update({run_key(r["run_dir"]): r for r in new})
    order = {run_key(r.run_dir): i for i, r in enumerate(expand(spec, read_choice(spec)))}
    return sorted(by_run.values(), key=lambda r: order.get(run_key(r["run_dir"]), len(order)))


def write_study(spec: StudySpec, stage: str) -> list[Run]:
    """Write study.yaml, each selected run's config.yaml up to `stage`, and merge them into
    runs.json (which keeps every run ever written); the stage's selected runs."""
    chosen = read_choice(spec)
    d = spec.study_dir
    d.mkdir(parents=True, exist_ok=True)
    resolved = dataclasses.asdict(spec)
    resolved["pairs"] = [list(p) for p in spec.pairs]
    del resolved["only"]  # which pieces ran is runs.json's to say
    atomic_write_text(d / SPEC_NAME, yaml.safe_dump(resolved, sort_keys=False))
    known = selected(spec, expand(spec, chosen,
                                  ("sweep",) if stage == "sweep" else ("sweep", "final")))
    for run in known:
        text = yaml.safe_dump(config_to_dict(run_config(spec, run)), sort_keys=False)
        Path(run.run_dir).mkdir(parents=True, exist_ok=True)
        if not _holds(run.config, text):  # a run being trained elsewhere: RunDirBusy, exit 75
            with held(run.run_dir):
                atomic_write_text(run.config, text)
    runs = merged_runs(spec, [r.record() for r in known])
    atomic_write_text(d / RUNS_NAME, json.dumps(runs, indent=2) + "\n")
    return [r for r in known if r.stage == stage]


def choose_lrs(spec: StudySpec) -> dict[str, float]:
    """Each selected variant's rate, the lowest validation loss of its sweep, merged into
    lr_choice.json; StudyError when a variant has no sweep run that finished, or (lr.extend_edges)
    when its best rate is at the edge of its grid."""
    assert spec.lr is not None  # called only for a study with lr:
    path = spec.study_dir / LR_CHOICE_NAME
    choice: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}
    missing: list[str] = []
    for variant in selected_variants(spec):
        runs = [r for r in expand(spec, None, ("sweep",)) if r.variant == variant]
        scores = {r.lr: sweep_score(spec, r) for r in runs}
        done = {lr: s for lr, s in scores.items() if s is not None}
        if not done:
            missing.append(variant)
            continue
        best = min(done, key=lambda lr: done[lr])
        choice[variant] = {"lr": best, "key": spec.rate_key(variant),
                           "scores": {f"{lr:g}": s for lr, s in scores.items()},
                           "failed": [r.run_dir for r in runs if scores[r.lr] is None],
                           "metric": sweep_metric(spec), "validation": spec.lr.validation}
    if missing:
        raise StudyError(f"no LR sweep run finished for variant(s) {', '.join(missing)}; see "
                         f"{spec.study_dir}/<variant>/lr*/ and rerun the study")
    edges = [edge_line(spec, v, choice[v]) for v in selected_variants(spec)] \
        if spec.lr.extend_edges else []
    if any(edges):
        raise StudyError("; ".join(e for e in edges if e))
    order = list(spec.variants)
    choice = dict(sorted(choice.items(), key=lambda kv: order.index(kv[0])
                         if kv[0] in order else len(order)))
    atomic_write_text(path, json.dumps(choice, indent=2) + "\n")
    return {v: c["lr"] for v, c in choice.items()}


def selected_variants(spec: StudySpec) -> list[str]:
    return [v for v in spec.variants if not spec.only or v in spec.only]


def edge_line(spec: StudySpec, variant: str, choice: dict) -> str:
    """The edge rule (lr.extend_edges): '' when the chosen rate is interior, else what to add,
    one step past the edge (the grid's ratio there)."""
    grid = sorted(float(lr) for lr in choice["scores"])
    best = float(choice["lr"])
    if len(grid) < 2 or grid[0] < best < grid[-1]:
        return ""
    nxt = best * best / grid[-2] if best == grid[-1] else best * best / grid[1]
    grid_text = ", ".join(f"{g:g}" for g in grid)
    return (f"{variant}: its best rate {best:g} is at the edge of its grid ({grid_text}); the "
            f"edge rule (lr.extend_edges): add {nxt:.3g} to its {spec.rate_key(variant)} grid "
            "(the variant's lr.values) and rerun")


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



def _edge_mark(chosen: Any, scores: dict[str, Any]) -> str:
    """" (grid edge)" when the chosen rate is the sweep's lowest or highest of several."""
    grid = sorted(float(lr) for lr in scores)
    if chosen is None or len(grid) < 2 or float(chosen) not in (grid[0], grid[-1]):
        return ""
    return " (grid edge: lowest)" if float(chosen) == grid[0] else " (grid edge: highest)"


def choice_markdown(lr_choice: dict[str, Any]) -> list[str]:
    """The report's learning-rate section: each variant's chosen rate and its sweep's scores."""
    if not lr_choice:
        return []
    metrics = {c.get("metric") for c in lr_choice.values() if c.get("metric")}
    lines = ["## Learning rate (chosen on validation)", "",
             f"Score: {', '.join(sorted(metrics)) or 'the validation metric'} (the chosen lr has "
             "the best score); a failed sweep run has no score. A choice at the edge of the grid "
             "is marked: the best rate may lie beyond it.", "",
             "| variant | chosen lr | scores (lr: score) |", "|---|---:|---|"]
    for variant, choice in lr_choice.items():
        scores = choice.get("scores") or {}
        cells = ", ".join(f"{lr}: {v:.4g}" if isinstance(v, (int, float)) else f"{lr}: failed"
                          for lr, v in scores.items())
        # a variant may sweep another rate (Muon's); train.lr in a study of before
        field = choice.get("key", "train.optimizer.lr")
        named = "" if field in ("train.optimizer.lr", "train.lr") else f"{field.split('.')[-1]} "
        lines.append(f"| {variant} | {named}{choice.get('lr')}"
                     f"{_edge_mark(choice.get('lr'), scores)} | {cells} |")
    return lines + [""]
