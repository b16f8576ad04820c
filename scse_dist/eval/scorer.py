"""The one scorer of every evaluation task: per row of a batch and per loop depth, the summed NLL
of the scored targets, their count, and whether each is the greedy argmax, from one loop run.
The LM head, softmax and argmax run only on the scored positions (LAMBADA scores a few per
passage), in chunks of rows whose logits go to one buffer reused across depths and batches.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

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
