"""The evaluation tasks' registry: one `Task` record each, in `TASKS`.

Everything else about a task (the values `eval.tasks` accepts, `scse-eval --task`, the study's
tasks, the reports' headline and direction) is derived from its record. A task is one module of
scse_dist.eval.tasks that registers its record when imported (docs/architecture.md). The config
layer reads this module, so the built-in tasks are imported on the registry's first use, not
from here, and reading it imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from scse_dist.config_paths import field_value

BUILTIN = "scse_dist.eval.tasks"  # the package whose modules register the built-in tasks


@dataclass(frozen=True)
class Task:
    name: str
    # (path) -> what the scorer reads: documents, passages... (a held-out shard dir is opened as
    # a token stream instead when `heldout` is set).
    reader: Callable[[str], Any]
    # (scse_dist.eval.task_run.TaskRun) -> rows, one dict per depth: {"depth": T, metric: value}
    scorer: Callable[[Any], list[dict]]
    metrics: tuple[str, ...]  # every metric a report may show (a study's report.metrics)
    table: tuple[str, ...]  # scse-eval's console columns
    report: tuple[str, ...]  # a run's report, headline first (the one plotted, and flagged flat)
    study_report: Optional[tuple[str, ...]] = None  # a study report's default; None: `report`
    higher_is_better: tuple[str, ...] = ()  # the metrics where higher is better (others: lower)
    # Its settings dataclass (its module's `Config`), set under eval.task_settings.<name>; a
    # `path` field there names its data file (without one it reads data.path). None: no settings.
    settings: Optional[type] = None
    # reads data.path's held-out split when it is a shard dir; max_batches applies
    heldout: bool = False
    scores_tokens: bool = True  # an exit rule (--exit) can stop each token's loop
    diagnostic: bool = False  # measures the loop, not quality: no headline for the study's flags,
    #                           no study metric table (the study plots it on its own)
    # During training (the downstream callback), for the tasks that set both: `totals` (TaskRun)
    # -> per depth {"depth": T, name: total, ...}, sums that add up across ranks' shares;
    # `from_totals` (one depth's summed totals) -> its row, as `scorer` gives it.
    totals: Optional[Callable[[Any], list[dict]]] = None
    from_totals: Optional[Callable[[dict], dict]] = None

    @property
    def data_field(self) -> Optional[str]:
        """The eval.* field naming its data file ("task_settings.lambada.path"); None: data.path."""
        has_path = self.settings is not None and "path" in {
            f.name for f in dataclasses.fields(self.settings)}
        return f"task_settings.{self.name}.path" if has_path else None

    @property
    def headline(self) -> str:
        return self.report[0]

    @property
    def study_metrics(self) -> tuple[str, ...]:
        return () if self.diagnostic else (self.study_report or self.report)

    def better(self, metric: str) -> str:
        return "higher" if metric in self.higher_is_better else "lower"

    @property
    def downstream(self) -> bool:
        """Whether it can run during training (the downstream callback's tasks)."""
        return self.totals is not None and self.from_totals is not None


@dataclass
class DataFile:
    """The settings of a task whose data file is all it takes: eval.task_settings.<task>.path."""

    path: Optional[str] = None  # the task's data file, a path or a URL


class Registry(dict[str, Task]):
    """name -> Task, in the order registered; reading it first imports BUILTIN, whose modules
    register the built-in tasks (so `register` and monkeypatch.setitem, which look first, add
    after them)."""

    loaded = False

    def _load(self) -> None:
        if not self.loaded:
            self.loaded = True
            importlib.import_module(BUILTIN)

    def __getitem__(self, name: str) -> Task:
        self._load()
        return super().__getitem__(name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return super().__contains__(name)

    def __iter__(self) -> Iterator[str]:
        self._load()
        return super().__iter__()

    def values(self):
        self._load()
        return super().values()

    def items(self):
        self._load()
        return super().items()


TASKS = Registry()


def register(task: Task) -> Task:
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is registered already")
    TASKS[task.name] = task
    return task


def unknown_task(name: Any) -> str:
    """"must be one of heldout, ...; got 'lambda' (did you mean 'lambada'?)" for a name that is
    no task (the caller puts the field in front)."""
    close = difflib.get_close_matches(str(name), list(TASKS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"must be one of {', '.join(TASKS)}; got {name!r}{hint}"


def either(names: list[str]) -> str:
    """'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def data_path(task: Task, cfg: Any) -> str:
    """The data `task` reads under the run config `cfg`: its eval.* file, else data.path."""
    own = field_value(cfg.eval, task.data_field) if task.data_field else None
    return own or cfg.data.path
