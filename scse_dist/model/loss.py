"""Cross-entropy of the LM head without full-vocabulary logits: `chunked_cross_entropy`.

The head matmul and the loss run over chunks of rows, and each chunk's gradient (softmax - onehot,
scaled by 1/kept tokens; the z-loss adds 2 z_weight * lse * softmax) is formed in the same pass,
so no chunk's logits outlive it and nothing is recomputed (3 matmuls, as unchunked); backward only
scales by the incoming gradient. Values equal the unchunked path's within fp32 summation order.

The head weight is an input of the autograd Function, not captured: a tied head (the embedding
matrix) then accumulates into the same .grad as the embedding lookup, and under ZeRO-3 the
weight is whatever the hooks gathered when the caller read the attribute.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # targets equal to this are left out of the loss (torch's default)
# Logits per chunk (rows x vocab) off CUDA: 2^24 fp32 values = 64 MiB (another size reorders the
# fp32 sums, and so the quickstart's numbers).
CHUNK_LOGITS = 1 << 24
# Rows per chunk on CUDA (torchtitan's), while a chunk's fp32 logits stay within a 64th of memory.
CUDA_CHUNK_ROWS = 8192


def chunk_rows(vocab: int, cuda_memory: Optional[int] = None) -> int:
    """Rows per chunk: CHUNK_LOGITS' share off CUDA; on a CUDA device of `cuda_memory` bytes,
    CUDA_CHUNK_ROWS or fewer (the comments above)."""
    if cuda_memory is None:
        return max(1, CHUNK_LOGITS // vocab)
    return max(1, min(CUDA_CHUNK_ROWS, cuda_memory // 64 // (4 * vocab)))


def _chunks(n_rows: int, vocab: int, device: torch.device) -> list[slice]:
    memory = torch.cuda.get_device_properties(device).total_memory \
        if device.type == "cuda" else None
    rows = chunk_rows(vocab, memory)
    return [slice(i, min(i + rows, n_rows)) for i in range(0, n_rows, rows)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """(objective, cross-entropy, z-loss term): the objective is the cross-entropy plus
    z_weight * mean(lse^2), and the only output with a gradient, formed in forward for it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                with_grad: bool, z_weight: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = targets != IGNORE_INDEX
        targets = targets.masked_fill(~valid, 0)
        count = valid.sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        total_z = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if with_grad else None
        # fp32 accumulator: the sum over chunks would otherwise round once per chunk in bf16.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if with_grad else None
        for rows in _chunks(hidden.shape[0], weight.shape[0], hidden.device):
            logits = F.linear(hidden[rows], weight).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            picked = logits.gather(1, targets[rows, None])
            total += ((lse - picked).squeeze(1) * valid[rows]).sum()
            if z_weight:
                total_z += (lse.squeeze(1).square() * valid[rows]).sum()
            if grad_h is None or grad_w is None:  # not with_grad
                continue
            # d mean / d logits = (softmax - onehot(target)) / count on kept rows, 0 on ignored;
            # the z-loss adds z_weight * 2 lse * softmax / count.
            grad_logits = logits.sub_(lse).exp_()
            if z_weight:
                grad_logits *= 1.0 + (2.0 * z_weight) * lse
            grad_logits.scatter_add_(1, targets[rows, None], torch.full_like(picked, -1.0))
            grad_logits *= (valid[rows] / count)[:, None]
            grad_logits = grad_logits.to(hidden.dtype)
            grad_h[rows] = grad_logits @ weight
            grad_w += (grad_logits.t() @ hidden[rows]).float()
        if grad_h is not None and grad_w is not None:  # with_grad
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        # 0/0 = nan when every target is ignored, as F.cross_entropy
        cross_entropy, z_term = total / count, z_weight * (total_z / count)
        objective = total / count if not z_weight else cross_entropy + z_term
        ctx.mark_non_differentiable(cross_entropy, z_term)
        return objective, cross_entropy, z_term

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_ce: torch.Tensor, _grad_z: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_loss.to(grad_h.dtype), grad_w * grad_loss.to(grad_w.dtype), None,
                None, None)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                          targets: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of `F.linear(hidden, weight)` (hidden (..., d), weight (V, d))
    against `targets` (long, hidden's leading shape) except IGNORE_INDEX, in row chunks."""
    return _apply(hidden, weight, targets, 0.0)[0]


class LossTerms(NamedTuple):
    objective: torch.Tensor  # cross_entropy + z_loss, with the gradient of both
    cross_entropy: torch.Tensor  # the mean cross-entropy alone (no gradient)
    z_loss: torch.Tensor  # z_weight * mean(logsumexp(logits)^2) (no gradient)


def chunked_cross_entropy_with_z_loss(hidden: torch.Tensor, weight: torch.Tensor,
                                      targets: torch.Tensor, z_weight: float) -> LossTerms:
    """chunked_cross_entropy plus PaLM's z-loss, z_weight * mean(logsumexp(logits)^2) over the
    same kept rows, in the same chunks. Only `objective` carries a gradient."""
    return LossTerms(*_apply(hidden, weight, targets, float(z_weight)))


def _apply(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
           z_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), with_grad,
                                      z_weight)


def z_loss_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean(logsumexp(logits)^2) over the rows whose target is kept, from full logits (..., V)
    (the unchunked path; its gradient by autograd)."""
    kept = targets.flatten() != IGNORE_INDEX
    lse = torch.logsumexp(logits.float().flatten(0, -2), dim=-1)
    return (lse.square() * kept).sum() / kept.sum()
