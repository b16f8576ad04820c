"""Scoring token windows at several loop depths in one forward pass per batch. A `Window` is a
token sequence whose targets from `first_scored` on count (the earlier ones are context only);
windows are batched longest first, and the scores come back in the windows' order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, cast

import torch

from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.scorer import IGNORE_INDEX, DepthScorer, Score, scoring_mode

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

class Window(NamedTuple):
    tokens: list[int]  # inputs tokens[:-1], targets tokens[1:]
    first_scored: int  # index into the targets of the first scored one


def document_windows(ids: list[int], eos_id: int, seq_len: int, stride: int) -> list[Window]:
    """Sliding windows over one document, EOS first (as in training): up to `seq_len` inputs
    each, `stride` apart, each scoring only the targets no earlier window scored."""
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


def documents_windows(documents: list[list[int]], eos_id: int, seq_len: int, stride: int
                      ) -> tuple[list[Window], list[int]]:
    """Every document's document_windows, and the document each window belongs to."""
    owned = [(w, i) for i, ids in enumerate(documents)
             for w in document_windows(ids, eos_id, seq_len, stride)]
    return [w for w, _ in owned], [i for _, i in owned]


def context_target_window(context: list[int], target: list[int], eos_id: int, seq_len: int
                          ) -> Window:
    """EOS + context + target, cut from the left to `seq_len` inputs; only the target is scored."""
    if not target:
        raise ValueError("context_target_window: empty target")
    if len(target) > seq_len:
        raise ValueError(f"target of {len(target)} tokens does not fit seq_len={seq_len}")
    seq = [eos_id, *context, *target][-(seq_len + 1):]
    return Window(seq, len(seq) - 1 - len(target))


class ScoringInterrupted(KeyboardInterrupt):
    """Ctrl-C while scoring windows: the depths and the scores so far, scores[d][i] None for a
    window not yet scored (a KeyboardInterrupt still, for callers that only stop)."""

    def __init__(self, depths: list[int], scores: list[list[Optional[Score]]]) -> None:
        super().__init__()
        self.depths, self.scores = depths, scores


def _padded(chunk: Sequence[Window]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of windows, right-padded (causal attention never sees it),
    targets IGNORE_INDEX but where scored."""
    width = max(len(w.tokens) for w in chunk) - 1
    inputs = torch.zeros(len(chunk), width, dtype=torch.long)
    targets = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
    for i, w in enumerate(chunk):
        n = len(w.tokens) - 1
        inputs[i, :n] = torch.tensor(w.tokens[:-1])
        targets[i, w.first_scored:n] = torch.tensor(w.tokens[w.first_scored + 1:])
    return inputs, targets


def score_windows(model: LoopedLM, windows: Sequence[Window], depths: list[int],
                  batch_size: int, exit_stats: Optional[ExitStats] = None, progress=None,
                  sort: bool = True) -> tuple[list[int], list[list[Score]]]:
    """(depths evaluated, scores[d_index][window]) in the windows' order. exit_stats: adaptive
    depth by its rule at its cap. progress: updated by each batch's windows. sort=False: batches
    in the windows' order. Ctrl-C raises ScoringInterrupted with the scores so far."""
    scorer = DepthScorer(model, depths, exit_stats)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].tokens)) if sort \
        else list(range(len(windows)))
    scores: list[list[Optional[Score]]] = [[None] * len(windows) for _ in scorer.depths]
    with scoring_mode(model):
        try:
            for start in range(0, len(order), batch_size):
                picked = order[start:start + batch_size]
                batch = scorer(*_padded([windows[i] for i in picked]))
                for k, per_row in enumerate(batch):
                    for i, score in zip(picked, per_row):
                        scores[k][i] = score
                if progress is not None:
                    progress.update(len(picked))
        except KeyboardInterrupt:
            raise ScoringInterrupted(scorer.depths, scores) from None
    return scorer.depths, cast("list[list[Score]]", scores)  # every window scored
