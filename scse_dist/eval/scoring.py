"""Scoring token windows at several loop depths in one forward pass per batch.

A `Window` is a token sequence whose targets from `first_scored` on count; the earlier ones are
context only. WikiText's sliding window and LAMBADA's context + target are both windows, so one
scorer serves both: per window and depth it returns the summed NLL of the scored targets, their
count, and whether every scored target is the greedy argmax.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.perplexity import IGNORE_INDEX, _resolve_depths


class Window(NamedTuple):
    tokens: list[int]  # inputs tokens[:-1], targets tokens[1:]
    first_scored: int  # index into the targets of the first scored one


class Score(NamedTuple):
    nll: float  # summed NLL (nats) of the scored targets
    count: int
    all_correct: bool  # every scored target is the argmax


def document_windows(ids: list[int], eos_id: int, seq_len: int, stride: int) -> list[Window]:
    """Sliding windows over one document, EOS first (a document follows EOS in training).

    Each window holds up to `seq_len` inputs; consecutive windows start `stride` apart and each
    scores only the targets no earlier window scored, so every token is scored once, with up to
    `seq_len - stride` tokens of context carried over.
    """
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride: must lie in 1..seq_len={seq_len}, got {stride}")
    seq = [eos_id, *ids]
    n_targets = len(seq) - 1
    windows, scored_to, begin = [], 0, 0
    while scored_to < n_targets:
        end = min(begin + seq_len, n_targets)  # targets begin..end-1
        windows.append(Window(seq[begin:end + 1], scored_to - begin))
        scored_to = end
        begin += stride
    return windows


def context_target_window(context: list[int], target: list[int], eos_id: int, seq_len: int) -> Window:
    """EOS + context + target, cut from the left to `seq_len` inputs; only the target is scored."""
    if not target:
        raise ValueError("context_target_window: empty target")
    if len(target) > seq_len:
        raise ValueError(f"target of {len(target)} tokens does not fit seq_len={seq_len}")
    seq = [eos_id, *context, *target][-(seq_len + 1):]
    return Window(seq, len(seq) - 1 - len(target))


def score_windows(model: torch.nn.Module, windows: Sequence[Window], depths: list[int],
                  batch_size: int, exit_stats: Optional[ExitStats] = None
                  ) -> tuple[list[int], list[list[Score]]]:
    """Score every window at every depth. Returns (depths evaluated, scores[d_index][window]).
    exit_stats: adaptive depth by its rule at one depth, the cap; it counts the scored tokens'
    steps."""
    depths = _resolve_depths(model, depths)
    if exit_stats is not None:
        depths = [exit_stats.depth(depths)]
    device = next(model.parameters()).device
    scores: list[list[Score]] = [[] for _ in depths]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(windows), batch_size):
                chunk = windows[start:start + batch_size]
                width = max(len(w.tokens) for w in chunk) - 1
                inputs = torch.zeros(len(chunk), width, dtype=torch.long)
                targets = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
                for i, w in enumerate(chunk):  # right padding: causal attention never sees it
                    n = len(w.tokens) - 1
                    inputs[i, :n] = torch.tensor(w.tokens[:-1])
                    targets[i, w.first_scored:n] = torch.tensor(w.tokens[w.first_scored + 1:])
                inputs, targets = inputs.to(device), targets.to(device)
                mask = targets.ne(IGNORE_INDEX)
                safe = targets.clamp_min(0)
                # one depth's logits at a time: a sweep at a large vocabulary fits in memory
                if exit_stats is None:
                    per_depth = model.iter_depth_logits(inputs, depths)
                else:
                    out = model(inputs, depth=depths[0], exit_rule=exit_stats.rule)
                    exit_stats.add(out.steps_used, mask)
                    per_depth = [(depths[0], out.logits)]
                for k, (_, logits) in enumerate(per_depth):
                    logits = logits.float()
                    nll = F.cross_entropy(logits.transpose(1, 2), safe, reduction="none") * mask
                    wrong = logits.argmax(-1).ne(safe) & mask
                    for i in range(len(chunk)):
                        scores[k].append(Score(float(nll[i].double().sum()), int(mask[i].sum()),
                                               not bool(wrong[i].any())))
    finally:
        model.train(was_training)
    return depths, scores
