"""The evaluation tasks' scorers, each at several loop depths in one forward per batch.

Each task is a record in scse_dist.task_registry (its reader, its scorer here, its metrics):
    heldout   perplexity on held-out shards (a dir with index.json), or on any JSONL/text corpus
    wikitext  WikiText raw: document-wise sliding window; ppl, word_ppl, bits_per_byte
    lambada   last-word prediction: accuracy (every target token is the argmax) and ppl per
              passage, both as lm-eval's LAMBADA tasks define them (acc, perplexity)
    hellaswag, piqa, arc_easy, arc_challenge, multiple_choice: lm-eval's acc and acc_norm
              (scse_dist.eval.multiple_choice)
    diagnose  per depth ||b|| (forcing bias at the anchor), ||D_t||, ||h_t - h_{t-1}||

A scorer takes a TaskRun and returns one row per depth. A task that can run during training
(eval.downstream_tasks) also has `totals` (per depth, additive sums over its examples) and
`from_totals` (a depth's row from those sums, summed over ranks). `run_task` is the one entry the
CLI and evaluate_export (scse_dist.eval.export_eval: the trainer, the launcher, a study) call: it
evaluates (with progress on rank 0: items done, rate, ETA), prints a table and writes the results
JSON (scse_dist.eval.results). On Ctrl-C it writes the results of the items done so far, marked
`"partial": {"done", "total", "unit"}` (scse_dist.run_dir.is_complete is then False for it), and
raises cli_errors.Interrupted with a line saying so.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional, cast

import torch

from scse_dist.cli_errors import InputError, Interrupted
from scse_dist.config import RunConfig
from scse_dist.data.sources import Passage
from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.inputs import TaskData, get_task, no_exit_rule, read_task_data
from scse_dist.eval.perplexity import HeldoutInterrupted, evaluate_heldout
from scse_dist.eval.results import format_table, write_results
from scse_dist.eval.scorer import resolve_depths
from scse_dist.eval.scoring import (
    Score,
    ScoringInterrupted,
    Window,
    context_target_window,
    document_windows,
    score_windows,
)
from scse_dist.model.exit_rules import ExitRule
from scse_dist.progress import Progress
from scse_dist.run_dir import PARTIAL_KEY

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

# With --exit: the steps each scored token used (ExitStats.summary).
STEP_METRICS = ("mean_steps", "steps_p50", "steps_p90")


def _exp(x: float) -> float:
    return math.exp(min(x, 700.0))


class TaskInterrupted(KeyboardInterrupt):
    """Ctrl-C inside a task: the rows of the items done (None if none) and how far it got."""

    def __init__(self, rows: Optional[list[dict]], done: int, total: Optional[int], unit: str):
        super().__init__()
        self.rows, self.done, self.total, self.unit = rows, done, total, unit


def _progress(desc: Optional[str], total: Optional[int], unit: str) -> Progress:
    """Progress of a task's items; desc None: quiet (not rank 0, or the caller asked)."""
    return Progress(total, desc or "", unit=unit, enabled=desc is not None)


def _scores(model: LoopedLM, windows: list[Window], depths: list[int], batch_size: int,
            exit_stats: Optional[ExitStats], desc: Optional[str], unit: str, item: str,
            per_item: Any) -> tuple[list[int], list[list[Score]]]:
    """score_windows with progress in `unit`s (one per window); on Ctrl-C, TaskInterrupted in
    `item`s from `per_item(depths, scores)`: (rows over the items whose windows are all
    scored, items done, items in all)."""
    try:
        with _progress(desc, len(windows), unit) as progress:
            return score_windows(model, windows, depths, batch_size, exit_stats, progress)
    except ScoringInterrupted as stop:
        rows, done, total = per_item(stop.depths, stop.scores)
        raise TaskInterrupted(rows if done else None, done, total, item) from None


def document_rows(model: LoopedLM, tokenizer: Any, documents: list[str], depths: list[int],
                  seq_len: int, stride: int, batch_size: int,
                  exit_stats: Optional[ExitStats] = None, desc: Optional[str] = None) -> list[dict]:
    """Token ppl, word ppl and bits per byte of `documents` (each scored on its own, sliding
    window).

    word_ppl = exp(total NLL / whitespace words of the original text) and bits_per_byte =
    total NLL / ln 2 / UTF-8 bytes: both divide the same total, so they compare across tokenizers.
    desc: a progress line's label (None: quiet). Ctrl-C: TaskInterrupted with the rows of the
    documents whose windows were all scored.
    """
    return [document_metrics(t) for t in _document_totals(*_document_scores(
        model, tokenizer, documents, depths, seq_len, stride, batch_size, exit_stats, desc),
        documents)]


def _document_scores(model: LoopedLM, tokenizer: Any, documents: list[str],
                     depths: list[int], seq_len: int, stride: int, batch_size: int,
                     exit_stats: Optional[ExitStats], desc: Optional[str]
                     ) -> tuple[list[int], list[list[Score]]]:
    ids = tokenizer.encode_batch([d.strip() for d in documents])
    windows, owner = [], []
    for i, doc in enumerate(ids):
        for w in document_windows(doc, tokenizer.eos_id, seq_len, stride):
            windows.append(w)
            owner.append(i)

    def per_document(depths: list[int], scores: list[list[Optional[Score]]]):
        complete = [True] * len(documents)
        for i, score in zip(owner, scores[0]):
            complete[i] = complete[i] and score is not None
        kept = [k for k, score in enumerate(scores[0]) if complete[owner[k]]]
        done = [d for d, ok in zip(documents, complete) if ok]
        table = [document_metrics(t) for t in _document_totals(
            depths, cast("list[list[Score]]", [[s[k] for k in kept] for s in scores]),
            done)] if done else None  # the kept windows' documents are complete: all scored
        return table, len(done), len(documents)

    return _scores(model, windows, depths, batch_size, exit_stats, desc, "window", "document",
                   per_document)


def _document_totals(depths: list[int], scores: list[list[Score]], documents: list[str]
                     ) -> list[dict]:
    """Per depth the additive totals of the documents' scores (summed over ranks in training)."""
    words = sum(len(d.split()) for d in documents)
    n_bytes = sum(len(d.encode("utf-8")) for d in documents)
    return [{"depth": d, "nll": sum(s.nll for s in per_window),
             "tokens": sum(s.count for s in per_window), "words": words, "bytes": n_bytes,
             "documents": len(documents)} for d, per_window in zip(depths, scores)]


def document_metrics(totals: dict) -> dict:
    """One depth's row from its totals (_document_totals, or their sum over ranks)."""
    nll, tokens = totals["nll"], totals["tokens"]
    return {"depth": totals["depth"], "loss": nll / tokens, "ppl": _exp(nll / tokens),
            "word_ppl": _exp(nll / totals["words"]),
            "bits_per_byte": nll / math.log(2) / totals["bytes"], "tokens": int(tokens),
            "words": int(totals["words"]), "bytes": int(totals["bytes"]),
            "documents": int(totals["documents"])}


def context_target_ids(tokenizer: Any, context_text: str, target_text: str
                       ) -> tuple[list[int], list[int]]:
    """Context and target ids. The target is what encoding context + target adds after the
    context's own encoding (how the model saw such text in training); if the tokenizer merges
    across the boundary, the target is encoded alone. (The lm-eval model scores its
    (context, continuation) requests with this too: scse_dist.lmeval.)"""
    context = tokenizer.encode(context_text)
    full = tokenizer.encode(context_text + target_text)
    if full[:len(context)] == context and len(full) > len(context):
        return context, full[len(context):]
    return context, tokenizer.encode(target_text.strip())


def lambada_rows(model: LoopedLM, tokenizer: Any, passages: list[Passage],
                 depths: list[int], seq_len: int, batch_size: int,
                 exit_stats: Optional[ExitStats] = None, desc: Optional[str] = None) -> list[dict]:
    """lm-eval's LAMBADA metrics (lambada_metrics) at each depth. desc: a progress line's label
    (None: quiet). Ctrl-C: TaskInterrupted with the rows of the passages scored."""
    return [lambada_metrics(t) for t in _lambada_totals(*_lambada_scores(
        model, tokenizer, passages, depths, seq_len, batch_size, exit_stats, desc))]


def _lambada_scores(model: LoopedLM, tokenizer: Any, passages: list[Passage],
                    depths: list[int], seq_len: int, batch_size: int,
                    exit_stats: Optional[ExitStats], desc: Optional[str]
                    ) -> tuple[list[int], list[list[Score]]]:
    windows: list[Window] = []
    for p in passages:
        context, target = context_target_ids(tokenizer, p.context, p.target)
        windows.append(context_target_window(context, target, tokenizer.eos_id, seq_len))

    def per_passage(depths: list[int], scores: list[list[Optional[Score]]]):
        done = [[s for s in per_depth if s is not None] for per_depth in scores]
        rows = [lambada_metrics(t) for t in _lambada_totals(depths, done)] if done[0] else []
        return rows, len(done[0]), len(passages)

    return _scores(model, windows, depths, batch_size, exit_stats, desc, "passage", "passage",
                   per_passage)


def _lambada_totals(depths: list[int], scores: list[list[Score]]) -> list[dict]:
    """Per depth the additive totals of the passages' scores (summed over ranks in training)."""
    return [{"depth": d, "correct": sum(s.all_correct for s in per_window),
             "nll": sum(s.nll for s in per_window),
             "target_tokens": sum(s.count for s in per_window), "examples": len(per_window)}
            for d, per_window in zip(depths, scores)]


def lambada_metrics(totals: dict) -> dict:
    """One depth's row from its totals (_lambada_totals, or their sum over ranks), as lm-eval's
    LAMBADA tasks define acc and perplexity: accuracy = passages whose every target token is the
    argmax / passages; loss = mean over passages of the target's summed NLL, ppl = exp(loss).
    Per passage, not per token: a per-token ppl is exp(loss)^(passages / target_tokens), a
    different number (1555 against lm-eval's 3.9e9 at 3 tokens a target, issue 42)."""
    n, nll = totals["examples"], totals["nll"]
    return {"depth": totals["depth"], "accuracy": totals["correct"] / n, "loss": nll / n,
            "ppl": _exp(nll / n), "examples": int(n), "target_tokens": int(totals["target_tokens"])}


def diagnose_rows(model: LoopedLM, batches: Iterable[torch.Tensor], depths: list[int],
                  max_batches: int = 0, desc: Optional[str] = None) -> list[dict]:
    """Mean per-token norms of the trained loop on real text (batches (B, S+1) of token ids).

    bias_norm: ||b|| = ||Phi(h*) - h*|| at the anchor (scse: h* = a(s); the other kinds: h* = s, the
    forcing bias their transition produces at the source). effective_bias_norm: where a zero
    deviation actually moves (scse: lambda * b, 0 for SCSE proper). deviation_norm: ||h_T - h*||;
    motion_norm: ||h_T - h_{T-1}||. desc: a progress line's label (None: quiet). Ctrl-C:
    TaskInterrupted with the means over the batches done.
    """
    depths = resolve_depths(model, depths)
    sums: dict[str, torch.Tensor] = {}
    n = 0
    try:
        with torch.inference_mode(), _progress(desc, max_batches or None, "batch") as progress:
            for i, batch in enumerate(batches):
                if max_batches and i >= max_batches:
                    break
                for k, v in _diagnose_batch(model, batch, depths).items():
                    sums[k] = sums.get(k, 0) + v
                n += 1
                progress.update(1)
    except KeyboardInterrupt:
        raise TaskInterrupted(_diagnose_table(sums, n, depths) if n else None, n,
                              max_batches or None, "batch") from None
    if n == 0:
        raise InputError("diagnose: the data held no batches")
    return _diagnose_table(sums, n, depths)


def _diagnose_batch(model: LoopedLM, batch: torch.Tensor, depths: list[int]
                    ) -> dict[str, torch.Tensor]:
    inputs = batch[:, :-1].to(next(model.parameters()).device)
    rope = model.rope(inputs)
    trace = model.core.trace(model.source(inputs, rope), max(depths), rope=rope)
    s, anchor = trace.ctx["source"], trace.ctx["anchor"]
    bias = (model.core.phi(anchor, s) - anchor).float().norm(dim=-1).mean()
    values = {"bias_norm": bias, "effective_bias_norm": model.core.forcing_bias_norm(trace.ctx),
              "deviation_norm": trace.deviation_norm,
              "motion_norm": torch.cat([trace.motion_norm.new_zeros(1), trace.motion_norm])}
    return {k: v.double().cpu() for k, v in values.items()}


def _diagnose_table(sums: dict[str, torch.Tensor], n: int, depths: list[int]) -> list[dict]:
    means = {k: v / n for k, v in sums.items()}
    return [{"depth": d, "bias_norm": float(means["bias_norm"]),
             "effective_bias_norm": float(means["effective_bias_norm"]),
             "deviation_norm": float(means["deviation_norm"][d]),
             "motion_norm": float(means["motion_norm"][d]), "batches": n} for d in depths]


def _packed_batches(tokenizer: Any, documents: list[str], seq_len: int, batch_size: int):
    """(B, seq_len + 1) batches of the documents end to end, EOS after each (as in training)."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(documents):
        stream += [*ids, tokenizer.eos_id]
    rows = [stream[i:i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len)]
    for i in range(0, len(rows), batch_size):
        yield torch.tensor(rows[i:i + batch_size])


def run_task(task: str, model: LoopedLM, cfg: RunConfig, data: str, depths: list[int],
             out_path: str, checkpoint_label: str, *, tokenizer: Any = None,
             stride: Optional[int] = None, max_batches: int = 0,
             task_data: Optional[TaskData] = None,
             exit_rule: Optional[ExitRule] = None, progress: bool = True) -> list[dict]:
    """Evaluate `task` on `data`, print a table, write `out_path`. Returns the rows.

    Sequence length and batch size come from cfg.data.seq_len and cfg.eval.batch_size; the data
    is `task_data` when read already, else read_task_data(task, cfg, data, tokenizer); stride
    defaults to seq_len // 2. exit_rule: adaptive depth per token (not diagnose), one row at
    the cap (the rule's max_steps, else max(depths)) with the steps used (ExitStats.summary).
    progress: items done, rate and ETA on stderr (scse_dist.progress), on rank 0 only.
    Ctrl-C: the results of the items done are written, marked "partial", and
    cli_errors.Interrupted says how far it got.
    """
    record = get_task(task)
    if exit_rule is not None and not record.scores_tokens:
        raise ValueError(f"exit_rule: {no_exit_rule(task)}")
    from scse_dist.distributed import is_rank0

    stats = ExitStats(exit_rule) if exit_rule is not None else None
    tokenizer, inputs, shards = task_data or read_task_data(task, cfg, data, tokenizer)
    seq_len, batch_size = cfg.data.seq_len, cfg.eval.batch_size
    stride = stride or max(1, seq_len // 2)
    extra: dict[str, Any] = {"data": str(data), "seq_len": seq_len, "batch_size": batch_size}
    desc = _progress_label(task, model, depths, exit_rule) if progress and is_rank0() else None
    try:
        rows = record.score(TaskRun(model, tokenizer, inputs, shards, depths, seq_len, stride,
                                    batch_size, max_batches, stats, desc, extra))
    except TaskInterrupted as stop:
        raise Interrupted(_write_partial(stop, task, out_path, checkpoint_label, cfg, stats,
                                         extra)) from None
    metrics = record.table
    if stats is not None:
        for row in rows:
            row.update(stats.summary())
        metrics += STEP_METRICS
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
    stream: `shards`), the settings, the ExitStats of an exit rule (None: fixed depths), a
    progress label (None: quiet) and `extra`, a dict of settings it adds to the results JSON."""

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


def heldout_rows(run: TaskRun) -> list[dict]:
    """Held-out shards (their heldout split, up to max_batches), or a corpus: every document
    scored on its own, windows without overlap."""
    if not run.shards:
        return document_rows(run.model, run.tokenizer, run.inputs, run.depths, run.seq_len,
                             run.seq_len, run.batch_size, run.exit_stats, run.desc)
    run.extra["max_batches"] = run.max_batches
    try:
        with _progress(run.desc, run.max_batches or None, "batch") as bar:
            return evaluate_heldout(run.model, run.inputs, run.depths, max_batches=run.max_batches,
                                    exit_stats=run.exit_stats, progress=bar,
                                    eos_id=run.inputs.eos)
    except HeldoutInterrupted as stop:
        raise TaskInterrupted(stop.rows, stop.batches, run.max_batches or None, "batch") from None


def wikitext_rows(run: TaskRun) -> list[dict]:
    run.extra["stride"] = run.stride
    return document_rows(run.model, run.tokenizer, run.inputs, run.depths, run.seq_len,
                         run.stride, run.batch_size, run.exit_stats, run.desc)


def lambada_task_rows(run: TaskRun) -> list[dict]:
    return lambada_rows(run.model, run.tokenizer, run.inputs, run.depths, run.seq_len,
                        run.batch_size, run.exit_stats, run.desc)


# During training (eval.downstream_tasks): each rank's totals over its share, summed over ranks,
# then each depth's row from the sums (the registry's `totals` and `from_totals`).
def wikitext_totals(run: TaskRun) -> list[dict]:
    return _document_totals(*_document_scores(run.model, run.tokenizer, run.inputs, run.depths,
                                              run.seq_len, run.stride, run.batch_size,
                                              run.exit_stats, run.desc), run.inputs)


def lambada_totals(run: TaskRun) -> list[dict]:
    return _lambada_totals(*_lambada_scores(run.model, run.tokenizer, run.inputs, run.depths,
                                            run.seq_len, run.batch_size, run.exit_stats, run.desc))


def diagnose_task_rows(run: TaskRun) -> list[dict]:
    run.extra["max_batches"] = run.max_batches
    batches = run.inputs if run.shards else _packed_batches(run.tokenizer, run.inputs,
                                                            run.seq_len, run.batch_size)
    return diagnose_rows(run.model, batches, run.depths, max_batches=run.max_batches,
                         desc=run.desc)


def _write_partial(stop: TaskInterrupted, task: str, out_path: str, checkpoint_label: str,
                   cfg: RunConfig, stats: Optional[ExitStats], extra: dict) -> str:
    """Write the rows of the items done, marked partial; the line that says how far it got."""
    total = f"/{stop.total}" if stop.total else ""
    where = f"{task}: {stop.done}{total} {stop.unit}{'es' if stop.unit == 'batch' else 's'} " \
            "scored (all depths in one pass)"
    if not stop.rows:
        return f"{where}; no results written"
    rows = stop.rows
    if stats is not None:
        for row in rows:
            row.update(stats.summary())
    extra = {**extra, PARTIAL_KEY: {"done": stop.done, "total": stop.total, "unit": stop.unit}}
    write_results(out_path, task, checkpoint_label, cfg, rows, extra=extra)
    return f"{where}; partial results in {out_path}"
