"""Scoring token windows at several loop depths in one forward pass per batch: the one scorer of
every evaluation task. A `Window` is a token sequence whose targets from `first_scored` on count
(the earlier ones are context only); windows are batched longest first, and the scores come back
in the windows' order. Per row and depth `DepthScorer` gives the summed NLL of the scored targets,
their count and whether each is the greedy argmax, from one loop run; the LM head, softmax and
argmax run only on the scored positions (LAMBADA scores a few per passage), in chunks of rows
whose logits go to one buffer reused across depths and batches.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Sequence, cast

import torch

from scse_dist.eval.exit_stats import ExitStats
from scse_dist.model.loss import CHUNK_LOGITS

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

# Targets equal to this are padding and do not count (the torch cross-entropy convention).
IGNORE_INDEX = -100


class Score(NamedTuple):
    nll: float  # summed NLL (nats) of the scored targets
    count: int  # type: ignore[assignment]  # the field shadows tuple.count: the token count
    all_correct: bool  # every scored target is the argmax


def resolve_depths(model: LoopedLM, depths: list[int]) -> list[int]:
    """The sorted distinct depths to evaluate; an untied model's own depth only (with a note)."""
    fixed = getattr(model, "fixed_depth", None)
    if fixed is not None:
        if list(depths) != [fixed]:
            print(f"note: untied model has a fixed depth of {fixed}; evaluating depth {fixed} only "
                  f"(requested {list(depths)})")
        return [fixed]
    if not depths or any(int(d) < 1 for d in depths):
        raise ValueError(f"depths: need a non-empty list of depths >= 1, got {list(depths)}")
    return sorted({int(d) for d in depths})


@contextlib.contextmanager
def scoring_mode(model: LoopedLM) -> Iterator[None]:
    """Eval mode and no autograd while scoring; the model's training flag is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


class DepthScorer:
    """Scores (inputs, targets) batches at `depths` (resolve_depths) of one loop run, or with
    `exit_stats` at its cap by its exit rule (adding the steps each scored token used)."""

    def __init__(self, model: LoopedLM, depths: list[int],
                 exit_stats: Optional[ExitStats] = None, eos_id: Optional[int] = None) -> None:
        self.model, self.eos_id = model, eos_id
        self.depths = resolve_depths(model, depths)
        if exit_stats is not None:
            self.depths = [exit_stats.depth(self.depths)]
        self.exit_stats = exit_stats
        self.device = next(model.parameters()).device
        self._logits = torch.empty(0, device=self.device)  # reused: see _head

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[list[Score]]:
        """inputs, targets (B, S) long, targets IGNORE_INDEX where not scored. Returns
        scores[depth index][row]. Call under scoring_mode."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        scored = targets.ne(IGNORE_INDEX)
        rows = scored.nonzero(as_tuple=True)[0]  # the row of each scored position, row-major
        wanted = targets[scored]
        counts = scored.sum(1).tolist()
        out = []
        for hidden, weight in self._head_inputs(inputs, scored):
            nll, wrong = self._head(hidden, weight, wanted)
            nll_row = torch.zeros(len(counts), dtype=torch.float64, device=self.device)
            wrong_row = torch.zeros(len(counts), dtype=torch.long, device=self.device)
            nll_row.index_add_(0, rows, nll.double())
            wrong_row.index_add_(0, rows, wrong.long())
            out.append([Score(n, c, w == 0) for n, c, w in
                        zip(nll_row.tolist(), counts, wrong_row.tolist())])
        return out

    def _head_inputs(self, inputs: torch.Tensor, scored: torch.Tensor
                     ) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Per depth: the head's inputs (N, d) at the scored positions and the head weight, or
        (exit rule) the model's logits (N, V) and None."""
        docs = None if self.eos_id is None else self.model.documents(inputs, self.eos_id)
        if self.exit_stats is not None:
            out = self.model(inputs, depth=self.depths[0], exit_rule=self.exit_stats.rule,
                             document_ids=docs)
            self.exit_stats.add(out.steps_used, scored)
            yield out.logits[scored], None
            return
        for _, hidden in self.model.iter_depth_head_inputs(inputs, self.depths, docs):
            yield hidden[scored], self.model.head_weight

    def _head(self, hidden: torch.Tensor, weight: Optional[torch.Tensor], wanted: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) NLL and (N,) bool "not the argmax" of `wanted` under the head's logits, formed
        a chunk of rows at a time in one reused fp32 buffer."""
        vocab = weight.shape[0] if weight is not None else hidden.shape[1]
        step = max(1, CHUNK_LOGITS // vocab)
        nll = torch.empty(len(wanted), dtype=torch.float32, device=self.device)
        wrong = torch.empty(len(wanted), dtype=torch.bool, device=self.device)
        for start in range(0, len(wanted), step):
            part = slice(start, start + step)
            logits = self._logits_of(hidden[part], weight)
            target = wanted[part, None]
            wrong[part] = logits.argmax(-1).ne(wanted[part])
            picked = logits.gather(1, target).squeeze(1)
            top = logits.amax(-1, keepdim=True)
            lse = logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(1))
            nll[part] = lse - picked
        return nll, wrong

    def _logits_of(self, hidden: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
        """(n, V) fp32 logits in a view of the reused buffer."""
        if weight is None:
            return hidden.float().clone()  # exit rule: logits already formed by the model
        n, vocab = hidden.shape[0], weight.shape[0]
        if self._logits.numel() < n * vocab:
            self._logits = torch.empty(n * vocab, dtype=torch.float32, device=self.device)
        logits = self._logits[:n * vocab].view(n, vocab)
        if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.matmul(hidden, weight.t(), out=logits)
        return logits.copy_(torch.matmul(hidden, weight.t()))  # bf16 on a GPU: fp32 after


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
