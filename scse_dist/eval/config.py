"""The `eval:` section of a run config: depths, batches, evaluation during training, the tasks
`scse-launch` runs after training and each task's own settings (eval.task_settings, built as the
class its record names). It imports only the config layer (the task registry, typed YAML,
ConfigError), so `scse_dist.config` composes it without loading the evaluators (or torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scse_dist.model.config import ConfigError
from scse_dist.resources import EvalResources
from scse_dist.task_registry import TASKS, Task, field_value, unknown_task
from scse_dist.typed_yaml import build_dataclass


@dataclass
class EvalConfig:
    """Each field's meaning: docs/config.md (the eval.* rows)."""

    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48])
    batch_size: int = 8
    max_batches: int = 0  # 0: the whole held-out split
    after_train: bool = True
    every_steps: int = 0  # during training: held-out loss at `depths` (0: off)
    sample_every: int = 0  # during training: continuations of sample_prompts (0: off)
    sample_prompts: list[str] = field(
        default_factory=lambda: ["The", "Return the", "This module provides"])
    sample_tokens: int = 32
    sample_temperature: float = 0.8
    downstream_every: int = 0  # during training: downstream_tasks at `depths` (0: off)
    downstream_tasks: list[str] = field(default_factory=list)
    downstream_max_examples: int = 0  # per task and evaluation (0: all)
    tasks: list[str] = field(default_factory=lambda: ["heldout"])  # scse-launch's, after training
    # task -> its settings (its record's `settings` class: a mapping of its fields as given,
    # the dataclass once built); a task not named here takes that class's defaults
    task_settings: dict[str, Any] = field(default_factory=dict)
    resources: EvalResources = field(default_factory=EvalResources)  # each evaluation job's

    def __post_init__(self) -> None:
        """Each eval.task_settings entry built as its task's settings class (ConfigError)."""
        for name, values in self.task_settings.items():
            where = f"eval.task_settings.{name}"
            if name not in TASKS:
                raise ConfigError(f"{where}: {unknown_task(name)}")
            cls = TASKS[name].settings
            if cls is None:
                raise ConfigError(f"{where}: {name} has no settings (it reads data.path)")
            if not isinstance(values, cls):
                if not isinstance(values, dict):
                    raise ConfigError(f"{where}: expected a mapping, got {values!r}")
                self.task_settings[name] = build_dataclass(cls, values, where)

    def settings(self, task: str) -> Any:
        """`task`'s settings: eval.task_settings.<task>, else its class's defaults (None if
        it has no settings)."""
        cls = TASKS[task].settings
        return self.task_settings.get(task) or (cls() if cls is not None else None)

    def check(self) -> None:
        """Values no evaluation can use, and each listed task's data file (ConfigError naming the
        field)."""
        if any(x <= 0 for x in self.depths) or not self.depths:
            raise ConfigError(f"eval.depths: need a non-empty list of depths >= 1, got "
                              f"{self.depths}")
        if self.batch_size <= 0:
            raise ConfigError(f"eval.batch_size: must be > 0, got {self.batch_size}")
        for i, task in enumerate(self.tasks):
            self._check_task("tasks", i, task)
        if self.sample_every and not all(p.strip() for p in self.sample_prompts or [""]):
            raise ConfigError("eval.sample_prompts: need at least one prompt, none empty, when "
                              "eval.sample_every is set")
        if self.sample_tokens < 1:
            raise ConfigError(f"eval.sample_tokens: must be >= 1, got {self.sample_tokens}")
        for name, own in self.task_settings.items():
            problem = getattr(own, "problem", lambda: None)()
            if problem:
                raise ConfigError(f"eval.task_settings.{name}.{problem}")
        for name in ("every_steps", "max_batches", "sample_every",
                     "sample_temperature", "downstream_every", "downstream_max_examples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name}: must be >= 0, got {getattr(self, name)}")
        self._check_downstream()
        res = self.resources
        problem = res.problem() or ("an evaluation is one task on one node: nodes and "
                                    "tasks_per_node must be 1" if (res.nodes, res.tasks_per_node)
                                    != (1, 1) else None)
        if problem or res.time_min < 1:
            raise ConfigError(f"eval.resources: {problem or 'time_min must be >= 1'}, got "
                              f"{dataclasses.asdict(res)}")

    def _check_task(self, listed: str, i: int, task: str) -> Task:
        """The record of eval.<listed>[i], a task whose data file (if it has one) is set."""
        if task not in TASKS:
            raise ConfigError(f"eval.{listed}[{i}]: {unknown_task(task)}")
        need = TASKS[task].data_field
        if need and not field_value(self, need):
            raise ConfigError(f"eval.{need}: eval.{listed} lists {task!r}, so set eval.{need} "
                              "to its data file")
        return TASKS[task]

    def _check_downstream(self) -> None:
        able = [name for name, task in TASKS.items() if task.downstream]
        for i, task in enumerate(self.downstream_tasks):
            where = f"eval.downstream_tasks[{i}]"
            if not self._check_task("downstream_tasks", i, task).downstream:
                raise ConfigError(f"{where}: {task!r} does not run during training (held-out "
                                  f"loss: eval.every_steps); the tasks that do: {', '.join(able)}")
            if task in self.downstream_tasks[:i]:
                raise ConfigError(f"{where}: {task!r} is listed twice")
        if self.downstream_every and not self.downstream_tasks:
            raise ConfigError("eval.downstream_tasks: eval.downstream_every is set, so name the "
                              f"tasks to run (any of {', '.join(able)})")


def task_files(eval_cfg: EvalConfig) -> dict[str, str]:
    """Field -> file of every data file the eval section names ("eval.task_settings.lambada.path":
    its path), whether or not a listed task reads it."""
    return {f"eval.task_settings.{name}.path": own.path
            for name, own in eval_cfg.task_settings.items() if getattr(own, "path", None)}
