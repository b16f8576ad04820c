"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from scse_dist.config import TrainConfig


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier for optimizer step s (0-based: the s-th update uses lr * self(s)).

    Warmup ramps 1/W, 2/W, ..., 1 over steps 0..W-1; the cosine then runs from 1 at step W to
    exactly min_ratio at the last step (max_steps - 1) and stays there past it.
    """

    warmup_steps: int
    max_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.max_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> LambdaLR:
    # A LambdaLR handed to deepspeed.initialize is stepped by the engine once per optimizer step and
    # saved in its checkpoints, so a resumed run continues the same curve.
    return LambdaLR(optimizer, WarmupCosine(train.warmup_steps, train.max_steps, train.min_lr_ratio))
