"""Per-step loop depth T for training, drawn identically on every rank without communication."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from scse_dist.train.config import TrainConfig
from scse_dist.train.depth_config import DepthSamplingConfig


def depth_mean(step: int, sampling: DepthSamplingConfig, target: int, total_steps: int) -> float:
    """The mean depth step `step` draws around under train.depth.curriculum: `target`
    (model.depth) when off or once the ramp is over; before that start + (target - start) * f(x),
    x = step / (fraction * total_steps), f = x (linear) or 1 - sqrt(1 - x) (1-sqrt)."""
    ramp = sampling.curriculum
    if ramp.shape == "none":
        return float(target)
    x = min(1.0, step / (ramp.fraction * total_steps))
    shaped = x if ramp.shape == "linear" else 1.0 - math.sqrt(1.0 - x)
    return ramp.start + (target - ramp.start) * shaped


def sample_depth(step: int, sampling: DepthSamplingConfig, mean_depth: int, seed: int,
                 total_steps: Optional[int] = None) -> int:
    """T for optimizer step `step`: a pure function of (seed, step, config), so all ranks agree
    and a resumed run draws the same depths as an uninterrupted one.

    fixed: `mean_depth`. uniform: U{min, max}, max 0 meaning 2*mean_depth. poisson_lognormal
    (Huginn): tau ~ N(log(mean) - sigma^2/2, sigma), T ~ Poisson(exp(tau)), so E[T] = mean before
    clipping to >= min (and <= max when max > 0).

    train.depth.curriculum (it needs `total_steps`, train.max_steps) replaces the mean by
    depth_mean's: fixed draws it rounded (halves up, at least 1); uniform scales its upper bound
    by mean / mean_depth (at least min); poisson_lognormal draws around it. Off, the draws are
    the same as without a curriculum, bit for bit.
    """
    ramped = sampling.curriculum.shape != "none"
    if ramped and total_steps is None:
        raise ValueError("sample_depth: train.depth.curriculum needs total_steps")
    mean: float = depth_mean(step, sampling, mean_depth, total_steps or 0) if ramped \
        else mean_depth
    if sampling.kind == "fixed":
        return max(1, math.floor(mean + 0.5)) if ramped else mean_depth
    rng = np.random.default_rng([seed, step])
    if sampling.kind == "uniform":
        high = sampling.max or 2 * mean_depth
        if ramped:
            high = math.floor(high * mean / mean_depth + 0.5)
        return int(rng.integers(sampling.min, max(high, sampling.min) + 1))
    if sampling.kind == "poisson_lognormal":
        sigma = sampling.sigma
        tau = rng.normal(math.log(mean) - 0.5 * sigma * sigma, sigma)
        depth = max(int(rng.poisson(math.exp(tau))), sampling.min)
        return min(depth, sampling.max) if sampling.max else depth
    raise ValueError(f"train.depth.kind: unknown sampling kind {sampling.kind!r}")


def short_depth_loss(t: TrainConfig) -> dict[str, Any]:
    """train_step's arguments for train.loss.depth ({} when off)."""
    loss = t.loss.depth
    return {"short_depth": loss.short, "short_weight": loss.weight} \
        if loss.kind == "two_depths" else {}
