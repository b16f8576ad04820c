"""The evaluation tasks: one `Task` record each, in the registry `TASKS`.

Everything else about a task is derived from its record: the values `eval.tasks` accepts (and
which config field must then name its data file), `scse-eval --task`, the data the launcher
hands each evaluation job, the study spec's tasks and `report.metrics`, the reports' headline,
direction and metrics, and the study's pathology flags. Adding a task is one record here plus
its reader and scorer (docs/architecture.md, "An evaluation task").

This module sits beside config.py, below eval/: config validation reads it, and the layers let
config import nothing above it. So it names its reader and scorer by import path
("module:function"), resolved on first use; reading the registry imports no torch, which keeps
bad input rejected before torch loads. A record may hold the functions themselves instead
(a plugin, or a test registering a toy task).
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

Ref = Union[str, Callable[..., Any]]  # "package.module:function", or the function


def resolve(ref: Ref) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Task:
    name: str
    # (path) -> what the scorer reads: documents, passages... (a held-out shard dir is opened as
    # a token stream instead when `heldout` is set).
    reader: Ref
    # (scse_dist.eval.tasks.TaskRun) -> rows, one dict per depth: {"depth": T, metric: value, ...}
    scorer: Ref
    metrics: tuple[str, ...]  # every metric a report may show (a study's report.metrics)
    table: tuple[str, ...]  # scse-eval's console columns
    report: tuple[str, ...]  # a run's report, headline first (the one plotted, and flagged flat)
    study_report: Optional[tuple[str, ...]] = None  # a study report's default; None: `report`
    higher_is_better: tuple[str, ...] = ()  # the metrics where higher is better (others: lower)
    # The eval.* field naming its data file ("lambada": eval.lambada, "data.toy": eval.data.toy);
    # None: it reads data.path.
    data_field: Optional[str] = None
    # reads data.path's held-out split when it is a shard dir; max_batches applies
    heldout: bool = False
    scores_tokens: bool = True  # an exit rule (--exit) can stop each token's loop
    diagnostic: bool = False  # measures the loop, not quality: no headline for the study's flags,
    #                           no study metric table (the study plots it on its own)
    # During training (eval.downstream_tasks), for the tasks that set both: `totals`
    # (TaskRun) -> per depth {"depth": T, name: total, ...}, sums over the run's examples that
    # add up across ranks' shares; `from_totals` (one depth's summed totals) -> its row, as
    # `scorer` gives it. None: the task does not run during training.
    totals: Optional[Ref] = None
    from_totals: Optional[Ref] = None

    @property
    def headline(self) -> str:
        return self.report[0]

    @property
    def study_metrics(self) -> tuple[str, ...]:
        return () if self.diagnostic else (self.study_report or self.report)

    def better(self, metric: str) -> str:
        return "higher" if metric in self.higher_is_better else "lower"

    def read(self, path: str) -> Any:
        return resolve(self.reader)(path)

    def score(self, run: Any) -> list[dict]:
        return resolve(self.scorer)(run)

    @property
    def downstream(self) -> bool:
        """Whether it can run during training (eval.downstream_tasks)."""
        return self.totals is not None and self.from_totals is not None

    def share_totals(self, run: Any) -> list[dict]:
        return resolve(self.totals)(run)  # type: ignore[arg-type]

    def row_of(self, totals: dict) -> dict:
        return resolve(self.from_totals)(totals)  # type: ignore[arg-type]


TASKS: dict[str, Task] = {}


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


def field_value(eval_cfg: Any, dotted: str) -> Any:
    """eval_cfg's `dotted` field ("lambada", or "data.toy" inside the eval.data mapping)."""
    node = eval_cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def data_path(task: Task, cfg: Any) -> str:
    """The data `task` reads under the run config `cfg`: its eval.* file, else data.path."""
    own = field_value(cfg.eval, task.data_field) if task.data_field else None
    return own or cfg.data.path


_SOURCES = "scse_dist.data.sources"
_TASKS = "scse_dist.eval.tasks"
register(Task("heldout", f"{_SOURCES}:read_corpus", f"{_TASKS}:heldout_rows",
              metrics=("ppl", "loss"), table=("ppl", "loss"), report=("ppl",), heldout=True))
register(Task("wikitext", f"{_SOURCES}:read_wikitext_articles", f"{_TASKS}:wikitext_rows",
              metrics=("ppl", "word_ppl", "bits_per_byte", "loss"),
              table=("ppl", "word_ppl", "bits_per_byte"),
              report=("word_ppl", "ppl", "bits_per_byte"),
              study_report=("ppl", "word_ppl", "bits_per_byte"), data_field="wikitext",
              totals=f"{_TASKS}:wikitext_totals", from_totals=f"{_TASKS}:document_metrics"))
register(Task("lambada", f"{_SOURCES}:read_lambada", f"{_TASKS}:lambada_task_rows",
              metrics=("ppl", "accuracy", "loss"), table=("accuracy", "ppl"),
              report=("accuracy", "ppl"), study_report=("ppl", "accuracy"),
              higher_is_better=("accuracy",), data_field="lambada",
              totals=f"{_TASKS}:lambada_totals", from_totals=f"{_TASKS}:lambada_metrics"))
register(Task("diagnose", f"{_SOURCES}:read_corpus", f"{_TASKS}:diagnose_task_rows",
              metrics=("bias_norm", "effective_bias_norm", "deviation_norm", "motion_norm"),
              table=("bias_norm", "deviation_norm", "motion_norm"),
              report=("deviation_norm", "motion_norm", "bias_norm"), heldout=True,
              scores_tokens=False, diagnostic=True))

# Multiple choice, scored as lm-eval scores these tasks (scse_dist.eval.multiple_choice); each
# reads its local file from eval.data.<name> (formats: scse_dist.data.multiple_choice).
_MC_READERS = {"hellaswag": "read_hellaswag", "piqa": "read_piqa", "arc_easy": "read_arc",
               "arc_challenge": "read_arc", "multiple_choice": "read_multiple_choice"}
for _name, _reader in _MC_READERS.items():
    register(Task(_name, f"scse_dist.data.multiple_choice:{_reader}",
                  "scse_dist.eval.multiple_choice:mc_task_rows",
                  metrics=("acc_norm", "accuracy", "acc_bytes"), table=("accuracy", "acc_norm"),
                  report=("acc_norm", "accuracy"),
                  higher_is_better=("acc_norm", "accuracy", "acc_bytes"),
                  data_field=f"data.{_name}", totals="scse_dist.eval.multiple_choice:mc_totals",
                  from_totals="scse_dist.eval.multiple_choice:mc_metrics"))
