"""Per-step loop depth T for training, drawn identically on every rank without communication."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from scse_dist.config import DepthSamplingConfig, TrainConfig


def sample_depth(step: int, sampling: DepthSamplingConfig, mean_depth: int, seed: int) -> int:
    """T for optimizer step `step`: a pure function of (seed, step), so all ranks agree and a
    resumed run draws the same depths as an uninterrupted one.

    fixed: `mean_depth`. uniform: U{min, max}, max 0 meaning 2*mean_depth. poisson_lognormal
    (Huginn): tau ~ N(log(mean) - sigma^2/2, sigma), T ~ Poisson(exp(tau)), so E[T] = mean before
    clipping to >= min (and <= max when max > 0).
    """
    if sampling.kind == "fixed":
        return mean_depth
    rng = np.random.default_rng([seed, step])
    if sampling.kind == "uniform":
        high = sampling.max or 2 * mean_depth
        return int(rng.integers(sampling.min, max(high, sampling.min) + 1))
    if sampling.kind == "poisson_lognormal":
        sigma = sampling.sigma
        tau = rng.normal(math.log(mean_depth) - 0.5 * sigma * sigma, sigma)
        depth = max(int(rng.poisson(math.exp(tau))), sampling.min)
        return min(depth, sampling.max) if sampling.max else depth
    raise ValueError(f"train.depth.kind: unknown sampling kind {sampling.kind!r}")


def short_depth_loss(t: TrainConfig) -> dict[str, Any]:
    """train_step's arguments for train.loss.depth ({} when off)."""
    loss = t.loss.depth
    return {"short_depth": loss.short, "short_weight": loss.weight} \
        if loss.kind == "two_depths" else {}
