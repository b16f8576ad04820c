"""train.depth: the loop depth T each training step draws (scse_dist.train.depth samples it) and
its curriculum. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from scse_dist.typed_yaml import ConfigError


@dataclass
class DepthCurriculumConfig:
    """train.depth.curriculum: the mean training depth ramps from `start` to model.depth over the
    first `fraction` of train.max_steps, `linear` or `1-sqrt` (scse_dist.train.depth)."""

    shape: Literal["none", "linear", "1-sqrt"] = "none"
    start: float = 1.0
    fraction: float = 0.25

    def check(self) -> None:
        if self.shape not in ("none", "linear", "1-sqrt"):
            raise ConfigError(f"train.depth.curriculum.shape: expected none, linear or 1-sqrt, "
                              f"got {self.shape!r}")
        if not 1 <= self.start < float("inf"):  # also rejects NaN
            raise ConfigError(f"train.depth.curriculum.start: must be >= 1, got {self.start}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"train.depth.curriculum.fraction: must be > 0 and <= 1, got "
                              f"{self.fraction}")


@dataclass
class DepthSamplingConfig:
    # fixed: T = model.depth; uniform: U{min, max} (max 0: 2*model.depth); poisson_lognormal
    kind: Literal["fixed", "uniform", "poisson_lognormal"] = "fixed"
    min: int = 2
    max: int = 0
    sigma: float = 0.5
    # Backpropagate through only the last k loop steps (0: all of them).
    backprop_steps: int = 0
    curriculum: DepthCurriculumConfig = field(default_factory=DepthCurriculumConfig)

    def check(self) -> None:
        self.curriculum.check()
        if self.min <= 0:
            raise ConfigError(f"train.depth.min: must be > 0, got {self.min}")
        if self.backprop_steps < 0:
            raise ConfigError(f"train.depth.backprop_steps: must be >= 0, got "
                              f"{self.backprop_steps}")
        if self.kind == "uniform" and self.max and self.max < self.min:
            raise ConfigError(f"train.depth.max: {self.max} is below train.depth.min={self.min}")
        if self.sigma <= 0:
            raise ConfigError(f"train.depth.sigma: must be > 0, got {self.sigma}")


def largest_trained_depth(sampling: DepthSamplingConfig, mean_depth: int) -> int:
    """The deepest T training draws: uniform's max (2*mean when 0), poisson_lognormal's max, or
    2*mean when it is unbounded (its tail past that is rare), fixed's mean."""
    if sampling.kind == "fixed":
        return mean_depth
    return max(sampling.max or 2 * mean_depth, sampling.min)
