"""The `eval:` section of a run config: depths, batches, evaluation during training, the tasks
`scse-launch` runs after training and each task's own settings (eval.task_settings, built as the
class its record names). It imports only the config layer (the task registry, typed YAML,
ConfigError), so `scse_dist.config` composes it without loading the evaluators (or torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from scse_dist.config_paths import field_value
from scse_dist.resources import EvalResources
from scse_dist.task_registry import TASKS, Task, unknown_task
from scse_dist.typed_yaml import ConfigError, build_dataclass


@dataclass
class EvalConfig:
    """Each field's meaning: docs/config.md (the eval.* rows)."""

    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48])
    batch_size: int = field(default=8, metadata={"gt": 0})
    max_batches: int = field(default=0, metadata={"ge": 0})  # 0: the whole held-out split
    after_train: bool = True
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
        for i, task in enumerate(self.tasks):
            self._check_task("tasks", i, task)
        for name, own in self.task_settings.items():
            problem = getattr(own, "problem", lambda: None)()
            if problem:
                raise ConfigError(f"eval.task_settings.{name}.{problem}")
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


def task_files(eval_cfg: EvalConfig) -> dict[str, str]:
    """Field -> file of every data file the eval section names ("eval.task_settings.lambada.path":
    its path), whether or not a listed task reads it."""
    return {f"eval.task_settings.{name}.path": own.path
            for name, own in eval_cfg.task_settings.items() if getattr(own, "path", None)}
