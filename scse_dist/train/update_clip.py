"""train.optimizer.update_clip: AdamW's step per tensor divided by max(1, RMS / update_clip), where
RMS = sqrt(mean(g^2 / max(v_hat, eps^2))) over the tensor (StableAdamW, Wortsman et al. 2023,
arXiv 2304.13013, at update_clip 1); the moments update as in AdamW, the weight decay scales
with the step.

Applied after torch's AdamW has stepped: each parameter moves from its old value by (AdamW's
change) / factor, an exact lerp when the factor is 1. Under ZeRO-1/2, where the optimizer steps
one flat partition per group per rank, `attach_zero_layouts` records where each parameter lies,
and the sums of a parameter split between ranks are all-reduced: "per tensor" stays per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class Layout:
    """Where a group's parameters lie in one rank's flat partition (ZeRO-1/2): one (start,
    length) per parameter of the group, length 0 where none of it is here, its full size, and the
    process group its partitions are split over."""

    segments: list[tuple[int, int]]
    numels: list[int]
    group: Any = None


def ratio_sums(grad: torch.Tensor, exp_avg_sq: torch.Tensor, step: Any, beta2: float,
               eps: float, layout: Optional[Layout] = None) -> torch.Tensor:
    """Sum of g^2 / max(v_hat, eps^2) over the tensor (1 value) or over each of the layout's
    segments (one per parameter), in fp32."""
    bias = 1 - beta2 ** (step.float() if torch.is_tensor(step) else float(step))
    v_hat = exp_avg_sq.float() / bias
    ratio = grad.float().pow(2) / v_hat.clamp(min=eps * eps)
    if layout is None:
        return ratio.sum().reshape(1)
    flat = ratio.reshape(-1)
    return torch.stack([flat.narrow(0, start, length).sum()
                        for start, length in layout.segments])


def clip_factors(sums: torch.Tensor, numels: torch.Tensor, update_clip: float) -> torch.Tensor:
    """max(1, RMS / update_clip) from the ratio sums and the tensors' sizes."""
    return ((sums / numels).sqrt() / update_clip).clamp(min=1.0)


class UpdateClippedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step per tensor is divided by max(1, RMS / update_clip)."""

    def __init__(self, params: Any, *, update_clip: float, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.update_clip = update_clip
        # id(flat partition) -> its Layout, set by attach_zero_layouts under ZeRO-1/2
        self.layouts: dict[int, Layout] = {}
        # the last step's factor per stepped tensor (or per parameter of a layout)
        self.last_factors: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        stepped = [(p, group) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        before = [p.detach().clone() for p, _ in stepped]
        loss = super().step(closure)
        self.last_factors = []
        for (p, group), old in zip(stepped, before):
            factor = self._factor(p, group)
            self.last_factors.append(factor)
            layout = self.layouts.get(id(p))
            if layout is not None:  # one factor per parameter, spread over its segment
                weight = torch.ones_like(p, dtype=torch.float32).reshape(-1)
                for (start, length), f in zip(layout.segments, factor):
                    weight.narrow(0, start, length).fill_(1.0 / f)
                weight = weight.reshape(p.shape).to(p.dtype)
            else:
                weight = (1.0 / factor).to(p.dtype).reshape(())
            p.copy_(old.lerp(p, weight))  # exactly p where the weight is 1
        return loss

    def _factor(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        layout = self.layouts.get(id(p))
        assert p.grad is not None  # step passes only the tensors with a gradient
        sums = ratio_sums(p.grad, state["exp_avg_sq"], state["step"], group["betas"][1],
                          group["eps"], layout)
        if layout is not None and layout.group is not None and dist.is_initialized() \
                and dist.get_world_size(layout.group) > 1:
            dist.all_reduce(sums, group=layout.group)
        numels = torch.tensor([p.numel()] if layout is None else layout.numels,
                              dtype=torch.float32, device=sums.device)
        return clip_factors(sums, numels, self.update_clip)


def attach_zero_layouts(zero_optimizer: Any, clipped: UpdateClippedAdamW) -> None:
    """Give `clipped` the layout of every flat partition a ZeRO-1/2 optimizer steps through it:
    the group's parameters in DeepSpeed's flat order (each followed by its padding), cut at this
    rank's partition."""
    for i, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        group = zero_optimizer.real_dp_process_group[i]
        size = zero_optimizer.partition_size[i]
        lo = dist.get_rank(group=group) * size if dist.is_initialized() else 0
        segments, numels, offset = [], [], 0
        params = zero_optimizer.round_robin_bit16_groups[i]
        for p, padding in zip(params, zero_optimizer.round_robin_bit16_padding[i]):
            start, end = max(offset, lo), min(offset + p.numel(), lo + size)
            segments.append((start - lo, end - start) if end > start else (0, 0))
            numels.append(p.numel())
            offset += p.numel() + padding
        clipped.layouts[id(flat)] = Layout(segments, numels, group)
