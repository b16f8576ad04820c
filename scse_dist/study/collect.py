"""A study directory read back (layout: scse_dist.study.plan): its spec, its runs, and what each
run left behind. A run is finished when its evaluation JSONs exist; anything else (no run dir,
no results, an unreadable JSON) makes it a missing run, named in the report with the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig, load_config, load_saved_config
from scse_dist.eval.results import read_results
from scse_dist.run_dir import VALIDATION_NAME, RunDir
from scse_dist.study.plan import LR_CHOICE_NAME, RUNS_NAME, SPEC_NAME, run_key
from scse_dist.study.spec import default_pairs


@dataclass
class StudyRun:
    """One (variant, seed, lr, stage) of the study and, when it finished, its results."""

    variant: str
    seed: int
    lr: Optional[float]
    stage: str
    run_dir: Path
    config: Optional[RunConfig] = None
    results: dict[str, dict[int, dict]] = field(default_factory=dict)  # task -> depth -> row
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl rows, in order
    missing: Optional[str] = None  # why the run has no results

    @property
    def label(self) -> str:
        """Unique within a study (a sweep run's says so: the final run may share its lr)."""
        lr = f" lr={self.lr:g}" if self.lr is not None else ""
        return f"{self.variant}/seed{self.seed}{lr}" + (" sweep" if self.stage == "sweep" else "")


@dataclass
class Study:
    dir: Path
    name: str
    spec: dict
    runs: list[StudyRun]
    lr_choice: dict[str, Any]

    @property
    def variants(self) -> list[str]:
        """The spec's variant order (then any others the runs name)."""
        spec = self.spec.get("variants") or {}
        names = list(spec) if isinstance(spec, dict) else [v if isinstance(v, str) else v["name"]
                                                            for v in spec]
        return names + sorted({r.variant for r in self.runs} - set(names))

    @property
    def pairs(self) -> list[tuple[str, str]]:
        """The spec's pairs (an empty list is none), else study.spec.default_pairs."""
        if self.spec.get("pairs") is not None:
            return [(str(a), str(b)) for a, b in self.spec["pairs"]]
        return default_pairs({v: (v, ()) for v in self.variants})

    @property
    def exclude_flagged(self) -> bool:
        return bool(self.spec.get("exclude_flagged", False))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None


def _resolve_run_dir(study_dir: Path, run_dir: str) -> Path:
    """A runs.json path: absolute, relative to the study dir, or to the cwd scse-study ran in
    (elsewhere, the part after the study dir's name is taken relative to the study dir)."""
    p = Path(run_dir)
    if p.is_absolute() or p.exists() and not (study_dir / p).exists():
        return p
    if not (study_dir / p).exists() and study_dir.name in p.parts:
        tail = p.parts[len(p.parts) - 1 - p.parts[::-1].index(study_dir.name) + 1:]
        return study_dir.joinpath(*tail)
    return study_dir / p


def _run_config(study_dir: Path, run: StudyRun, entry: dict) -> Optional[RunConfig]:
    """run_dir/config.yaml (as saved), else runs.json's config (a path or a dict); None if neither
    reads."""
    given = entry.get("config")
    if isinstance(given, str):
        given = _resolve_run_dir(study_dir, given)
    saved = RunDir(run.run_dir).config
    for c in (saved, given):
        try:
            if isinstance(c, dict) or (c == saved and saved.is_file()):
                return load_saved_config(c)
            if isinstance(c, (str, Path)) and Path(c).is_file():
                return load_config(c)
        except (ValueError, OSError):
            continue
    return None


def load_run(study_dir: Path, entry: dict) -> StudyRun:
    run = StudyRun(variant=str(entry["variant"]), seed=int(entry["seed"]),
                   lr=None if entry.get("lr") is None else float(entry["lr"]),
                   stage=str(entry.get("stage", "final")),
                   run_dir=_resolve_run_dir(study_dir, str(entry["run_dir"])))
    run.metrics = RunDir(run.run_dir).training_rows()
    run.config = _run_config(study_dir, run, entry)
    if not run.run_dir.is_dir():
        run.missing = "no run dir (never started)"
        return run
    config_from_eval = None
    for f in sorted(RunDir(run.run_dir).eval.glob("*.json")):
        if f.stem == VALIDATION_NAME:  # a sweep run's score on the validation split: not a result
            continue
        try:
            data = read_results(f)
        except InputError as exc:
            run.missing = f"unreadable results: {exc}"
            run.results = {}
            return run
        # a task's evaluation under another name (on another text) is not that task's result
        if data is not None and data["task"] == f.stem:
            run.results[data["task"]] = {r["depth"]: r for r in data["results"]}
            config_from_eval = config_from_eval or data.get("config")
    if run.config is None and config_from_eval:
        run.config = load_saved_config(config_from_eval)
    validation = RunDir(run.run_dir).results(VALIDATION_NAME)
    if run.stage == "final" and run.results and validation.is_file():  # the validation stage's
        data = read_results(validation)
        if data is not None:
            run.results[VALIDATION_NAME] = {r["depth"]: r for r in data["results"]}
    if not run.results and not (run.stage == "sweep" and validation.is_file()):
        steps = [r["step"] for r in run.metrics if "step" in r]
        planned = run.config.train.max_steps if run.config else "?"
        where = f"training stopped at step {steps[-1]} of {planned}" if steps else "no training log"
        run.missing = f"no evaluation results ({where})"
    return run


def unsubmitted(study_dir: Path, spec: dict, entries: list) -> list[dict]:
    """The final runs the spec (study.yaml) names that runs.json does not: a study run in pieces
    lists the pieces not run yet, never drops them."""
    variants, seeds = spec.get("variants"), spec.get("seeds")
    if not isinstance(variants, dict) or not isinstance(seeds, list):
        return []
    have = {(str(e["variant"]), int(e["seed"])) for e in entries
            if e.get("stage", "final") == "final"}
    return [{"variant": v, "seed": s, "stage": "final",
             "run_dir": str(study_dir / v / f"{v}-seed{s}")}
            for s in seeds for v in variants if (v, s) not in have]


def load_study(study_dir: str | Path) -> Study:
    study_dir = Path(study_dir)
    spec_path, runs_path = study_dir / SPEC_NAME, study_dir / RUNS_NAME
    if not runs_path.is_file():
        raise FileNotFoundError(f"{study_dir}: no runs.json (not a study dir; run scse-study "
                                "first)")
    spec = yaml.safe_load(spec_path.read_text()) if spec_path.is_file() else {}
    entries = _read_json(runs_path)
    if not isinstance(entries, list):
        raise InputError(f"{runs_path}: expected a list of runs")
    # one entry a run (the last): a study written before run_key could list a run twice
    entries = list({run_key(str(e["run_dir"])): e for e in entries}.values())
    lr_path = study_dir / LR_CHOICE_NAME
    return Study(dir=study_dir, name=str(spec.get("name") or study_dir.name), spec=spec or {},
                 runs=[load_run(study_dir, e) for e in entries + unsubmitted(study_dir, spec,
                                                                             entries)],
                 lr_choice=_read_json(lr_path) if lr_path.is_file() else {})


def finite(value: Any) -> Optional[float]:
    """value as a float when it is a finite number, else None (diverged results are null)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
