"""diagnose: the trained loop measured on real text, per depth ||b|| (the forcing bias at the
anchor), ||D_t|| and ||h_t - h_{t-1}||; held-out shards or a corpus (packed as in training).
It measures the loop, not quality: no exit rule, no headline for the study's flags."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from scse_dist.cli_errors import InputError
from scse_dist.data.sources import read_corpus
from scse_dist.eval.task_run import TaskInterrupted, TaskRun, task_progress
from scse_dist.task_registry import Task, register

if TYPE_CHECKING:
    import torch

    from scse_dist.model import LoopedLM


def diagnose_rows(model: LoopedLM, batches: Iterable[torch.Tensor], depths: list[int],
                  max_batches: int = 0, desc: Optional[str] = None) -> list[dict]:
    """Mean per-token norms of the trained loop on real text (batches (B, S+1) of token ids).

    bias_norm: ||b|| = ||Phi(h*) - h*|| at the anchor (scse: h* = a(s); the other kinds: h* = s).
    effective_bias_norm: where a zero deviation actually moves (scse: lambda * b).
    deviation_norm: ||h_T - h*||; motion_norm: ||h_T - h_{T-1}||. Ctrl-C: TaskInterrupted with
    the means over the batches done.
    """
    import torch

    from scse_dist.eval.scoring import resolve_depths

    depths = resolve_depths(model, depths)
    sums: dict[str, torch.Tensor] = {}
    n = 0
    try:
        with torch.inference_mode(), task_progress(desc, max_batches or None, "batch") as progress:
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
    import torch

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
    import torch

    stream: list[int] = []
    for ids in tokenizer.encode_batch(documents):
        stream += [*ids, tokenizer.eos_id]
    rows = [stream[i:i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len)]
    for i in range(0, len(rows), batch_size):
        yield torch.tensor(rows[i:i + batch_size])


def diagnose_task_rows(run: TaskRun) -> list[dict]:
    run.extra["max_batches"] = run.max_batches
    batches = run.inputs if run.shards else _packed_batches(run.tokenizer, run.inputs,
                                                            run.seq_len, run.batch_size)
    return diagnose_rows(run.model, batches, run.depths, max_batches=run.max_batches,
                         desc=run.desc)


TASK = register(Task("diagnose", read_corpus, diagnose_task_rows,
                     metrics=("bias_norm", "effective_bias_norm", "deviation_norm", "motion_norm"),
                     table=("bias_norm", "deviation_norm", "motion_norm"),
                     report=("deviation_norm", "motion_norm", "bias_norm"), heldout=True,
                     scores_tokens=False, diagnostic=True))
