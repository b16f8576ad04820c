"""Held-out perplexity at several loop depths, from one forward per batch.

The model reads out every requested depth in a single pass (`readout_depths`), which the method
spec guarantees equals separate forwards at each depth. Token NLL is summed per depth over the
whole split and divided once at the end, so a ragged last batch is weighted by its real token count
rather than as a full batch.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from scse_dist.eval.exit_stats import ExitStats

# Targets equal to this are padding and do not count (the torch cross-entropy convention).
IGNORE_INDEX = -100


def _resolve_depths(model: torch.nn.Module, depths: list[int]) -> list[int]:
    fixed = getattr(model, "fixed_depth", None)
    if fixed is not None:
        if list(depths) != [fixed]:
            print(f"note: untied model has a fixed depth of {fixed}; evaluating depth {fixed} only "
                  f"(requested {list(depths)})")
        return [fixed]
    if not depths or any(int(d) < 1 for d in depths):
        raise ValueError(f"depths: need a non-empty list of depths >= 1, got {list(depths)}")
    return sorted({int(d) for d in depths})


def evaluate_heldout(model: torch.nn.Module, batches: Iterable[torch.Tensor], depths: list[int],
                     max_batches: int = 0, exit_stats: Optional[ExitStats] = None) -> list[dict]:
    """Mean token NLL and perplexity of `model` on `batches` (B, S+1) at each depth in `depths`.

    Returns `[{"depth", "loss", "ppl", "tokens"}]` sorted by depth. `max_batches` 0 means all.
    An untied model (`model.fixed_depth` set) is evaluated at its own depth only.
    exit_stats: adaptive depth by its rule, one row at the cap (ExitStats.depth); the steps each
    scored token used are added to it.
    """
    depths = _resolve_depths(model, depths)
    if exit_stats is not None:
        depths = [exit_stats.depth(depths)]
    untied = getattr(model, "fixed_depth", None) is not None
    device = next(model.parameters()).device
    nll_sum = {d: 0.0 for d in depths}
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for i, batch in enumerate(batches):
                if max_batches and i >= max_batches:
                    break
                if batch.dim() != 2 or batch.size(1) < 2:
                    raise ValueError(f"evaluate_heldout: expected token batches (B, S+1) with S >= 1, "
                                     f"got shape {tuple(batch.shape)}")
                batch = batch.to(device, non_blocking=True)
                inputs, targets = batch[:, :-1], batch[:, 1:]
                n = int(targets.ne(IGNORE_INDEX).sum())
                if exit_stats is not None:
                    out = model(inputs, targets, depth=depths[0], keep_logits=False,
                                exit_rule=exit_stats.rule)
                    losses = {depths[0]: out.loss}
                    exit_stats.add(out.steps_used, targets.ne(IGNORE_INDEX))
                elif untied:  # one depth, the model's own; it cannot read out others
                    out = model(inputs, targets, keep_logits=False)
                    losses = {depths[0]: out.loss}
                else:
                    out = model(inputs, targets, depth=max(depths), readout_depths=depths,
                                keep_logits=False)
                    losses = out.loss_by_depth
                for d in depths:
                    # mean CE * token count = summed NLL; accumulate in float64 on the host
                    nll_sum[d] += float(losses[d].double()) * n
                tokens += n
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("evaluate_heldout: the batches held no tokens (is the held-out split empty?)")
    rows = []
    for d in depths:
        loss = nll_sum[d] / tokens
        rows.append({"depth": d, "loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": tokens})
    return rows
