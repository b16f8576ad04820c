"""The `eval:` section of a run config: depths, batches, evaluation during training, the tasks
`scse-launch` runs after training and their data files. It imports only the task registry and
ConfigError, so `scse_dist.config` composes it without loading the evaluators (or torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from scse_dist.model.config import ConfigError
from scse_dist.resources import EvalResources
from scse_dist.task_registry import TASKS, Task, field_value, unknown_task


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
    wikitext: Optional[str] = None  # wiki.{valid,test}.raw path or URL, for the wikitext task
    lambada: Optional[str] = None  # LAMBADA JSONL or plain text, for the lambada task
    data: dict[str, str] = field(default_factory=dict)  # task -> its file (other tasks)
    stride: int = 0  # wikitext sliding-window stride; 0 means data.seq_len // 2
    resources: EvalResources = field(default_factory=EvalResources)  # each evaluation job's

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
        for name in ("stride", "every_steps", "max_batches", "sample_every",
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
