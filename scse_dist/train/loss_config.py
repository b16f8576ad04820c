"""train.loss: the terms added to the cross-entropy (scse_dist.train.step sums them; the depth
term's arguments: scse_dist.train.depth.short_depth_loss). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from scse_dist.typed_yaml import ConfigError


@dataclass
class DepthLossConfig:
    """train.loss.depth two_depths: the loss at loop depth `short`, read out from the same forward,
    joins the objective with `weight` (no term when the step's T <= short)."""

    kind: Literal["off", "two_depths"] = "off"
    weight: float = 0.5
    short: int = 2

    def check(self) -> None:
        if self.kind == "off":
            return
        if self.short < 1:
            raise ConfigError(f"train.loss.depth.short: must be >= 1, got {self.short}")
        if not 0 < self.weight < float("inf"):  # also rejects NaN
            raise ConfigError(f"train.loss.depth.weight: must be a finite weight > 0, got "
                              f"{self.weight}")


@dataclass
class LossConfig:
    """train.loss: terms added to the cross-entropy at the step's depth (which is logged)."""

    z_loss: float = 0.0
    depth: DepthLossConfig = field(default_factory=DepthLossConfig)

    def check(self) -> None:
        if not self.z_loss >= 0 or self.z_loss == float("inf"):  # also rejects NaN
            raise ConfigError(f"train.loss.z_loss: must be a finite weight >= 0, got {self.z_loss}")
        self.depth.check()
