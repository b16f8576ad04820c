"""Held-out perplexity at several loop depths, from one forward per batch (scse_dist.eval.scoring).

Token NLL is summed per depth over the whole split and divided once at the end, so a ragged last
batch is weighted by its real token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch

from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.scoring import DepthScorer, scoring_mode
from scse_dist.eval.task_run import TaskInterrupted, safe_exp

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM


def heldout_rows(depths: list[int], nll_sum: dict[int, float], tokens: int) -> list[dict]:
    """The rows of summed NLLs per depth over `tokens` tokens (the trainer's evaluation too)."""
    return [{"depth": d, "loss": nll_sum[d] / tokens, "ppl": safe_exp(nll_sum[d] / tokens),
             "tokens": tokens} for d in depths]


def evaluate_heldout(model: LoopedLM, batches: Iterable[torch.Tensor], depths: list[int],
                     max_batches: int = 0, exit_stats: Optional[ExitStats] = None,
                     progress=None, eos_id: Optional[int] = None) -> list[dict]:
    """Mean token NLL and perplexity of `model` on `batches` (B, S+1) at each depth in `depths`:
    `[{"depth", "loss", "ppl", "tokens"}]` sorted by depth. `max_batches` 0 means all.
    exit_stats: adaptive depth by its rule, one row at the cap. progress: a Progress, one per
    batch. eos_id: the batches' eos, so a model trained with model.document_mask is scored with
    it too. Ctrl-C raises TaskInterrupted with the rows of the batches done.
    """
    scorer = DepthScorer(model, depths, exit_stats, eos_id)
    nll_sum = {d: 0.0 for d in scorer.depths}
    tokens = done = 0
    with scoring_mode(model):
        try:
            for i, batch in enumerate(batches):
                if max_batches and i >= max_batches:
                    break
                if batch.dim() != 2 or batch.size(1) < 2:
                    raise ValueError(f"evaluate_heldout: expected token batches (B, S+1) with "
                                     f"S >= 1, got shape {tuple(batch.shape)}")
                scores = scorer(batch[:, :-1], batch[:, 1:])
                for d, per_row in zip(scorer.depths, scores):
                    nll_sum[d] += sum(s.nll for s in per_row)  # float64 sums, host side
                tokens += sum(s.count for s in scores[0])
                done += 1
                if progress is not None:
                    progress.update(1)
        except KeyboardInterrupt:
            raise TaskInterrupted(heldout_rows(scorer.depths, nll_sum, tokens) if tokens else None,
                                  done, max_batches or None, "batch") from None
    if tokens == 0:
        raise ValueError("evaluate_heldout: the batches held no tokens (is the held-out split "
                         "empty?)")
    return heldout_rows(scorer.depths, nll_sum, tokens)
