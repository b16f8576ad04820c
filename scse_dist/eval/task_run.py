"""What every evaluation task shares: `run_task`, the one entry the CLI and evaluate_export call,
the `TaskRun` a task's scorer gets (it returns one row per depth), and the scoring pieces several
tasks use. On Ctrl-C run_task writes the results of the items done, marked `"partial": {"done",
"total", "unit"}`, and raises cli_errors.Interrupted. No torch at the top: `scse-eval --help` and
config validation read the registry without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from scse_dist.cli_errors import Interrupted
from scse_dist.config import RunConfig
from scse_dist.eval.inputs import TaskData, get_task, no_exit_rule, read_task_data
from scse_dist.eval.results import format_table, write_results
from scse_dist.progress import Progress
from scse_dist.run_dir import PARTIAL_KEY

if TYPE_CHECKING:
    from scse_dist.eval.exit_stats import ExitStats
    from scse_dist.eval.scoring import Score, Window
    from scse_dist.model import LoopedLM
    from scse_dist.model.exit_rules import ExitRule

# With --exit: the steps each scored token used (ExitStats.summary).
STEP_METRICS = ("mean_steps", "steps_p50", "steps_p90")


def safe_exp(x: float) -> float:
    """exp(x), capped below float overflow (a ppl of a diverged model stays a number)."""
    return math.exp(min(x, 700.0))


class TaskInterrupted(KeyboardInterrupt):
    """Ctrl-C inside a task: the rows of the items done (None if none) and how far it got."""

    def __init__(self, rows: Optional[list[dict]], done: int, total: Optional[int], unit: str):
        super().__init__()
        self.rows, self.done, self.total, self.unit = rows, done, total, unit


def task_progress(desc: Optional[str], total: Optional[int], unit: str) -> Progress:
    """Progress of a task's items; desc None: quiet (not rank 0, or the caller asked)."""
    return Progress(total, desc or "", unit=unit, enabled=desc is not None)


def score_items(model: LoopedLM, windows: list[Window], owner: list[int], items: list,
                depths: list[int], batch_size: int, exit_stats: Optional[ExitStats],
                desc: Optional[str], unit: str, item: str, totals: Any, metrics: Any
                ) -> list[dict]:
    """Score the windows of `items` at every depth and return `totals` of their scores.

    totals(depths, scores, owner, items): owner[k] is the item window k belongs to; progress is
    in `unit`s. Ctrl-C: TaskInterrupted in `item`s with the `metrics` of the totals over the
    items whose windows are all scored."""
    from scse_dist.eval.scoring import ScoringInterrupted, score_windows

    try:
        with task_progress(desc, len(windows), unit) as progress:
            return totals(*score_windows(model, windows, depths, batch_size, exit_stats, progress),
                          owner, items)
    except ScoringInterrupted as stop:
        complete = [True] * len(items)
        for i, score in zip(owner, stop.scores[0]):
            complete[i] = complete[i] and score is not None
        done = [i for i, ok in enumerate(complete) if ok]
        kept = [k for k, i in enumerate(owner) if complete[i]]
        renumbered = {i: n for n, i in enumerate(done)}
        rows = [metrics(t) for t in totals(stop.depths, [[s[k] for k in kept] for s in stop.scores],
                                           [renumbered[owner[k]] for k in kept],
                                           [items[i] for i in done])] if done else None
        raise TaskInterrupted(rows, len(done), len(items), item) from None


def document_rows(model: LoopedLM, tokenizer: Any, documents: list[str], depths: list[int],
                  seq_len: int, stride: int, batch_size: int,
                  exit_stats: Optional[ExitStats] = None, desc: Optional[str] = None) -> list[dict]:
    """Token ppl, word ppl and bits per byte of `documents` (each scored on its own, sliding
    window). word_ppl = exp(total NLL / whitespace words of the original text) and bits_per_byte
    = total NLL / ln 2 / UTF-8 bytes compare across tokenizers. desc: a progress line's label
    (None: quiet). Ctrl-C: TaskInterrupted with the rows of the documents done."""
    return [document_metrics(t) for t in document_totals(
        model, tokenizer, documents, depths, seq_len, stride, batch_size, exit_stats, desc)]


def document_totals(model: LoopedLM, tokenizer: Any, documents: list[str], depths: list[int],
                    seq_len: int, stride: int, batch_size: int,
                    exit_stats: Optional[ExitStats] = None, desc: Optional[str] = None
                    ) -> list[dict]:
    """document_rows' additive totals per depth (in training summed over ranks, then rows)."""
    from scse_dist.eval.scoring import documents_windows

    windows, owner = documents_windows(tokenizer.encode_batch([d.strip() for d in documents]),
                                       tokenizer.eos_id, seq_len, stride)
    return score_items(model, windows, owner, documents, depths, batch_size, exit_stats, desc,
                   "window", "document", _document_totals, document_metrics)


def _document_totals(depths: list[int], scores: list[list[Score]], owner: list[int],
                     documents: list[str]) -> list[dict]:
    """Per depth the additive totals of the documents' scores."""
    words = sum(len(d.split()) for d in documents)
    n_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return [{"depth": d, "nll": sum(s.nll for s in per_window),
             "tokens": sum(s.count for s in per_window), "words": words, "bytes": n_bytes,
             "documents": len(documents)} for d, per_window in zip(depths, scores)]


def document_metrics(totals: dict) -> dict:
    """One depth's row from its totals (_document_totals, or their sum over ranks)."""
    nll, tokens = totals["nll"], totals["tokens"]
    return {"depth": totals["depth"], "loss": nll / tokens, "ppl": safe_exp(nll / tokens),
            "word_ppl": safe_exp(nll / totals["words"]),
            "bits_per_byte": nll / math.log(2) / totals["bytes"], "tokens": int(tokens),
            "words": int(totals["words"]), "bytes": int(totals["bytes"]),
            "documents": int(totals["documents"])}


def context_target_ids(tokenizer: Any, context_text: str, target_text: str
                       ) -> tuple[list[int], list[int]]:
    """Context and target ids. The target is what encoding context + target adds after the
    context's own encoding (how the model saw such text in training); if the tokenizer merges
    across the boundary, the target is encoded alone."""
    context = tokenizer.encode(context_text)
    full = tokenizer.encode(context_text + target_text)
    if full[:len(context)] == context and len(full) > len(context):
        return context, full[len(context):]
    return context, tokenizer.encode(target_text.strip())


def run_task(task: str, model: LoopedLM, cfg: RunConfig, data: str, depths: list[int],
             out_path: str, checkpoint_label: str, *, stride: Optional[int] = None,
             max_batches: int = 0, task_data: Optional[TaskData] = None,
             exit_rule: Optional[ExitRule] = None, progress: bool = True) -> list[dict]:
    """Evaluate `task` on `data`, print a table, write `out_path`. Returns the rows.

    Sequence length and batch size come from cfg.data.seq_len and cfg.eval.batch_size; the data
    is `task_data` when read already, else read by read_task_data; stride defaults to
    seq_len // 2. exit_rule: adaptive depth per token (not diagnose), one row at the cap (the
    rule's max_steps, else max(depths)) with the steps used (ExitStats.summary). progress:
    items done, rate and ETA on stderr, on rank 0 only.
    """
    record = get_task(task)
    if exit_rule is not None and not record.scores_tokens:
        raise ValueError(f"exit_rule: {no_exit_rule(task)}")
    from scse_dist.distributed import is_rank0
    from scse_dist.eval.exit_stats import ExitStats

    stats = ExitStats(exit_rule) if exit_rule is not None else None
    tokenizer, inputs, shards = task_data or read_task_data(task, cfg.data, cfg.model,
                                                            cfg.eval.batch_size, data)
    seq_len, batch_size = cfg.data.seq_len, cfg.eval.batch_size
    stride = stride or max(1, seq_len // 2)
    extra: dict[str, Any] = {"data": str(data), "seq_len": seq_len, "batch_size": batch_size}
    desc = _progress_label(task, model, depths, exit_rule) if progress and is_rank0() else None
    try:
        rows = record.scorer(TaskRun(model, tokenizer, inputs, shards, depths, seq_len, stride,
                                    batch_size, max_batches, stats, desc, extra,
                                    cfg.eval.settings(task)))
    except TaskInterrupted as stop:
        raise Interrupted(_write_partial(stop, task, out_path, checkpoint_label, cfg, stats,
                                         extra)) from None
    metrics = record.table + (STEP_METRICS if stats is not None else ())
    _add_steps(rows, stats)
    print(f"{task}: {checkpoint_label} ({cfg.model.recurrence}, {cfg.model.residual}) on {data}"
          + (f", exit {exit_rule}" if exit_rule is not None else ""))
    print(format_table(rows, metrics))
    if stats is not None:
        print("steps per token: " + ", ".join(f"{k}: {n}" for k, n in
                                               rows[0]["steps_histogram"].items()))
    write_results(out_path, task, checkpoint_label, cfg, rows, extra=extra)
    print(f"wrote {out_path}")
    return rows


def _progress_label(task: str, model: LoopedLM, depths: list[int],
                    exit_rule: Optional[ExitRule]) -> str:
    """`lambada T=1,8,48`, or with an exit rule `lambada exit motion:0.02`."""
    if exit_rule is not None:
        return f"{task} exit {exit_rule}"
    fixed = getattr(model, "fixed_depth", None)
    shown = [fixed] if fixed is not None else sorted({int(d) for d in depths})
    return f"{task} T={','.join(map(str, shown))}"


class TaskRun(NamedTuple):
    """What a task's scorer gets: the model, the data its reader read (or a held-out shard
    stream: `shards`), the settings, an exit rule's ExitStats, a progress label (None: quiet),
    `extra`, settings it adds to the results JSON, and the task's own settings."""

    model: LoopedLM
    tokenizer: Any
    inputs: Any
    shards: bool
    depths: list[int]
    seq_len: int
    stride: int
    batch_size: int
    max_batches: int
    exit_stats: Optional[ExitStats]
    desc: Optional[str]
    extra: dict
    settings: Any = None  # the task's own (eval.task_settings.<task>; its record's `settings`)


def _add_steps(rows: list[dict], stats: Optional[ExitStats]) -> list[dict]:
    """With an exit rule, every row gets the steps used (ExitStats.summary)."""
    if stats is not None:
        for row in rows:
            row.update(stats.summary())
    return rows


def _write_partial(stop: TaskInterrupted, task: str, out_path: str, checkpoint_label: str,
                   cfg: RunConfig, stats: Optional[ExitStats], extra: dict) -> str:
    """Write the rows of the items done, marked partial; the line that says how far it got."""
    total = f"/{stop.total}" if stop.total else ""
    where = f"{task}: {stop.done}{total} {stop.unit}{'es' if stop.unit == 'batch' else 's'} " \
            "scored (all depths in one pass)"
    if not stop.rows:
        return f"{where}; no results written"
    rows = _add_steps(stop.rows, stats)
    extra = {**extra, PARTIAL_KEY: {"done": stop.done, "total": stop.total, "unit": stop.unit}}
    write_results(out_path, task, checkpoint_label, cfg, rows, extra=extra)
    return f"{where}; partial results in {out_path}"
