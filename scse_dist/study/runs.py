"""A study spec's runs: each run's dir, stage and overrides (expand), its resolved run config
(run_config), and the check that every variant's config loads (check_runs). The spec, and where
its runs go: scse_dist.study.spec."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from scse_dist.config import RunConfig, config_from_dict, read_config_file, renamed_key
from scse_dist.config_paths import forget_overridden, resolve_paths
from scse_dist.run_dir import RunDir
from scse_dist.study.spec import SpecError, StudySpec
from scse_dist.task_registry import TASKS
from scse_dist.typed_yaml import ConfigError


@dataclass
class Run:
    variant: str
    seed: int
    lr: Optional[float]  # None: stage-2 rate not chosen yet
    stage: str  # "sweep" | "final"
    run_dir: str
    overrides: dict[str, Any]

    @property
    def config(self) -> str:
        return str(RunDir(self.run_dir).config)

    def record(self) -> dict:
        return {"variant": self.variant, "seed": self.seed, "lr": self.lr, "stage": self.stage,
                "run_dir": self.run_dir, "config": self.config, "overrides": self.overrides}


def expand(spec: StudySpec, chosen: dict[str, float] | None = None,
           stages: tuple[str, ...] = ("sweep", "final")) -> list[Run]:
    """Every run of the study. Final runs carry the chosen rate (None until it is chosen)."""
    runs: list[Run] = []
    rate: Optional[float]  # a sweep rate; a final run's chosen one (None: not chosen yet)
    d = spec.study_dir
    if spec.lr and "sweep" in stages:
        for variant, over in spec.variants.items():
            for rate in spec.rate_values(variant):
                extra = {spec.rate_key(variant): rate, "train.seed": spec.lr.seed}
                if spec.lr.steps:
                    extra["train.max_steps"] = spec.lr.steps
                runs.append(Run(variant, spec.lr.seed, rate, "sweep",
                                str(d / variant / f"{variant}-lr{rate:g}-seed{spec.lr.seed}"),
                                {**over, **extra}))
    if "final" in stages:
        # seed-major: every variant's seed 0 first, so a study cut short still compares variants
        grid = [(v, s) for s in spec.seeds for v in spec.variants] if spec.order == "seed-major" \
            else [(v, s) for v in spec.variants for s in spec.seeds]
        for variant, seed in grid:
            rate = (chosen or {}).get(variant) if spec.lr else None
            extra = {"train.seed": seed,
                     **({spec.rate_key(variant): rate} if rate is not None else {})}
            runs.append(Run(variant, seed, rate, "final",
                            str(d / variant / f"{variant}-seed{seed}"),
                            {**spec.variants[variant], **extra}))
    return runs


def _set_dotted(values: dict, key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    node = values
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"{where}: {key}: {part!r} is not a section")
    node[parts[-1]] = copy.deepcopy(value)


def run_config(spec: StudySpec, run: Run) -> RunConfig:
    """The resolved RunConfig of a run: base, study overrides, variant, seed/lr, then the study's
    fixed fields (run dir, evaluation tasks and depths; evaluations are the study's jobs)."""
    origins: dict[str, Path] = {}
    try:
        values = read_config_file(Path(spec.base), origins)
    except ConfigError as exc:
        raise SpecError(f"{spec.path}: base: {exc}") from None
    run_dir = Path(run.run_dir)
    study = {"name": run_dir.name, "output_dir": str(run_dir.parent),
             "eval.depths": spec.evals.depths, "eval.tasks": spec.evals.tasks,
             "eval.after_train": False, "wandb.group": spec.name}
    for task in TASKS.values():  # each task's data file, where the spec names one
        named = spec.evals.data.get(task.name) or getattr(spec.evals, task.name, None)
        if task.data_field and isinstance(named, str):  # evals.data.<task>, .wikitext, .lambada
            study[f"eval.{task.data_field}"] = named
    where = f"{spec.path}: variants.{run.variant}"
    given = {renamed_key(str(key), value): value
             for key, value in {**spec.overrides, **run.overrides, **study}.items()}
    for key, value in given.items():
        _set_dotted(values, key, value, where)
    # the base's relative input paths against its directory; the spec's are resolved already
    forget_overridden(origins, given)
    resolve_paths(values, origins)
    try:
        return config_from_dict(values)
    except ConfigError as exc:
        raise SpecError(f"{where} (run {run.run_dir}): {exc}") from None


def check_runs(spec: StudySpec) -> StudySpec:
    """The spec, once every variant's run config loads; SpecError naming the first that does not."""
    for run in expand(spec, chosen={v: 1e-3 for v in spec.variants}):
        run_config(spec, run)
    return spec
