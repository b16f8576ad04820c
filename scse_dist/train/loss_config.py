"""train.loss: the terms added to the cross-entropy (scse_dist.train.step sums them; the depth
term's arguments: scse_dist.train.depth.short_depth_loss). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DepthLossConfig:
    """train.loss.depth two_depths: the loss at loop depth `short`, read out from the same forward,
    joins the objective with `weight` (no term when the step's T <= short)."""

    kind: Literal["off", "two_depths"] = "off"
    weight: float = field(default=0.5, metadata={"gt": 0, "finite": True})
    short: int = field(default=2, metadata={"ge": 1})


@dataclass
class LossConfig:
    """train.loss: terms added to the cross-entropy at the step's depth (which is logged)."""

    z_loss: float = field(default=0.0, metadata={"ge": 0, "finite": True})
    depth: DepthLossConfig = field(default_factory=DepthLossConfig)
