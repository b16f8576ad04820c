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
    start: float = field(default=1.0, metadata={"ge": 1, "finite": True})
    fraction: float = field(default=0.25, metadata={"gt": 0, "le": 1})


@dataclass
class DepthSamplingConfig:
    # fixed: T = model.depth; uniform: U{min, max} (max 0: 2*model.depth); poisson_lognormal
    kind: Literal["fixed", "uniform", "poisson_lognormal"] = "fixed"
    min: int = field(default=2, metadata={"gt": 0})
    max: int = 0
    sigma: float = field(default=0.5, metadata={"gt": 0})
    # Backpropagate through only the last k loop steps (0: all of them).
    backprop_steps: int = field(default=0, metadata={"ge": 0})
    curriculum: DepthCurriculumConfig = field(default_factory=DepthCurriculumConfig)

    def check(self) -> None:
        if self.kind == "uniform" and self.max and self.max < self.min:
            raise ConfigError(f"train.depth.max: {self.max} is below train.depth.min={self.min}")


def largest_trained_depth(sampling: DepthSamplingConfig, mean_depth: int) -> int:
    """The deepest T training draws: uniform's max (2*mean when 0), poisson_lognormal's max, or
    2*mean when it is unbounded (its tail past that is rare), fixed's mean."""
    if sampling.kind == "fixed":
        return mean_depth
    return max(sampling.max or 2 * mean_depth, sampling.min)
