"""The evaluation tasks of `scse-eval`, each at several loop depths in one forward per batch.

    heldout   perplexity on held-out shards (a dir with index.json), or on any JSONL/text corpus
    wikitext  WikiText raw: document-wise sliding window; ppl, word_ppl, bits_per_byte
    lambada   last-word prediction: accuracy (every target token is the argmax), target ppl per
              token and word_ppl per target word (lm-eval's LAMBADA perplexity)
    diagnose  per depth ||b|| (forcing bias at the anchor), ||D_t||, ||h_t - h_{t-1}||

`run_task` is the one entry the CLI, the trainer and the launcher call: it evaluates, prints a
table and writes the results JSON (scse_dist.eval.results).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig
from scse_dist.model.exit_rules import ExitRule
from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.perplexity import _resolve_depths, evaluate_heldout
from scse_dist.data.sources import Passage
from scse_dist.eval.inputs import TaskData, read_task_data
from scse_dist.eval.results import format_table, write_results
from scse_dist.eval.scoring import Window, context_target_window, document_windows, score_windows

# Columns of each task's console table (all of them are in the JSON rows).
TABLE_METRICS = {"heldout": ("ppl", "loss"), "wikitext": ("ppl", "word_ppl", "bits_per_byte"),
                 "lambada": ("accuracy", "ppl"),
                 "diagnose": ("bias_norm", "deviation_norm", "motion_norm")}
# With --exit: the steps each scored token used (ExitStats.summary).
STEP_METRICS = ("mean_steps", "steps_p50", "steps_p90")


def _exp(x: float) -> float:
    return math.exp(min(x, 700.0))


def document_rows(model: torch.nn.Module, tokenizer: Any, documents: list[str], depths: list[int],
                  seq_len: int, stride: int, batch_size: int,
                  exit_stats: Optional[ExitStats] = None) -> list[dict]:
    """Token ppl, word ppl and bits per byte of `documents` (each scored on its own, sliding window).

    word_ppl = exp(total NLL / whitespace words of the original text) and bits_per_byte =
    total NLL / ln 2 / UTF-8 bytes: both divide the same total, so they compare across tokenizers.
    """
    ids = tokenizer.encode_batch([d.strip() for d in documents])
    windows = [w for doc in ids for w in document_windows(doc, tokenizer.eos_id, seq_len, stride)]
    depths, scores = score_windows(model, windows, depths, batch_size, exit_stats)
    words = sum(len(d.split()) for d in documents)
    n_bytes = sum(len(d.encode("utf-8")) for d in documents)
    rows = []
    for d, per_window in zip(depths, scores):
        nll = sum(s.nll for s in per_window)
        tokens = sum(s.count for s in per_window)
        rows.append({"depth": d, "loss": nll / tokens, "ppl": _exp(nll / tokens),
                     "word_ppl": _exp(nll / words), "bits_per_byte": nll / math.log(2) / n_bytes,
                     "tokens": tokens, "words": words, "bytes": n_bytes, "documents": len(documents)})
    return rows


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


def lambada_rows(model: torch.nn.Module, tokenizer: Any, passages: list[Passage],
                 depths: list[int], seq_len: int, batch_size: int,
                 exit_stats: Optional[ExitStats] = None) -> list[dict]:
    """accuracy: every target token is the argmax. ppl = exp(NLL / target tokens), per token;
    word_ppl = exp(NLL / passages), per target word: lm-eval's LAMBADA `perplexity` (the mean
    over passages of each target's summed log-likelihood), which compares across tokenizers."""
    windows: list[Window] = []
    for p in passages:
        context, target = context_target_ids(tokenizer, p.context, p.target)
        windows.append(context_target_window(context, target, tokenizer.eos_id, seq_len))
    depths, scores = score_windows(model, windows, depths, batch_size, exit_stats)
    rows = []
    for d, per_window in zip(depths, scores):
        nll = sum(s.nll for s in per_window)
        tokens = sum(s.count for s in per_window)
        rows.append({"depth": d, "accuracy": sum(s.all_correct for s in per_window) / len(per_window),
                     "loss": nll / tokens, "ppl": _exp(nll / tokens),
                     "word_ppl": _exp(nll / len(per_window)), "examples": len(per_window),
                     "target_tokens": tokens})
    return rows


def diagnose_rows(model: torch.nn.Module, batches: Iterable[torch.Tensor], depths: list[int],
                  max_batches: int = 0) -> list[dict]:
    """Mean per-token norms of the trained loop on real text (batches (B, S+1) of token ids).

    bias_norm: ||b|| = ||Phi(h*) - h*|| at the anchor (scse: h* = a(s); the other kinds: h* = s, the
    forcing bias their transition produces at the source). effective_bias_norm: where a zero
    deviation actually moves (scse: lambda * b, 0 for SCSE proper). deviation_norm: ||h_T - h*||;
    motion_norm: ||h_T - h_{T-1}||.
    """
    depths = _resolve_depths(model, depths)
    device = next(model.parameters()).device
    core = model.core
    sums: dict[str, torch.Tensor] = {}
    n = 0
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            inputs = batch[:, :-1].to(device)
            diag = model(inputs, depth=max(depths), diagnostics=True, keep_logits=False).diagnostics
            s = model.source(inputs)
            anchor = core.anchor_of(s)
            bias = (core.phi(anchor, s) - anchor).float().norm(dim=-1).mean()
            values = {"bias_norm": bias, "effective_bias_norm": diag["forcing_bias_norm"],
                      "deviation_norm": diag["deviation_norm"],
                      "motion_norm": torch.cat([diag["motion_norm"].new_zeros(1), diag["motion_norm"]])}
            for k, v in values.items():
                sums[k] = sums.get(k, 0) + v.double().cpu()
            n += 1
    if n == 0:
        raise InputError("diagnose: the data held no batches")
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


def run_task(task: str, model: torch.nn.Module, cfg: RunConfig, data: str, depths: list[int],
             out_path: str, checkpoint_label: str, *, tokenizer: Any = None,
             stride: Optional[int] = None, max_batches: int = 0,
             task_data: Optional[TaskData] = None,
             exit_rule: Optional[ExitRule] = None) -> list[dict]:
    """Evaluate `task` on `data`, print a table, write `out_path`. Returns the rows.

    Sequence length and batch size come from cfg.data.seq_len and cfg.eval.batch_size; the data
    is `task_data` when read already, else read_task_data(task, cfg, data, tokenizer); stride
    defaults to seq_len // 2. exit_rule: adaptive depth per token (not diagnose), one row at
    the cap (the rule's max_steps, else max(depths)) with the steps used (ExitStats.summary).
    """
    if exit_rule is not None and task == "diagnose":
        raise ValueError("exit_rule: diagnose measures the loop at fixed depths; use --exit with "
                         "heldout, wikitext or lambada")
    stats = ExitStats(exit_rule) if exit_rule is not None else None
    tokenizer, inputs, shards = task_data or read_task_data(task, cfg, data, tokenizer)
    seq_len, batch_size = cfg.data.seq_len, cfg.eval.batch_size
    stride = stride or max(1, seq_len // 2)
    extra: dict[str, Any] = {"data": str(data), "seq_len": seq_len, "batch_size": batch_size}
    if task == "heldout" and shards:
        rows = evaluate_heldout(model, inputs, depths, max_batches=max_batches, exit_stats=stats)
        extra["max_batches"] = max_batches
    elif task == "heldout":  # a corpus: every document scored on its own, no overlap
        rows = document_rows(model, tokenizer, inputs, depths, seq_len, seq_len, batch_size,
                             stats)
    elif task == "wikitext":
        rows = document_rows(model, tokenizer, inputs, depths, seq_len, stride, batch_size, stats)
        extra["stride"] = stride
    elif task == "lambada":
        rows = lambada_rows(model, tokenizer, inputs, depths, seq_len, batch_size, stats)
    else:
        batches = inputs if shards else _packed_batches(tokenizer, inputs, seq_len, batch_size)
        rows = diagnose_rows(model, batches, depths, max_batches=max_batches)
        extra["max_batches"] = max_batches
    metrics = TABLE_METRICS[task]
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
