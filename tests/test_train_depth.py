"""sample_depth: deterministic per (seed, step), and the right distribution for each kind."""

import numpy as np
import pytest

from scse_dist.train.depth import sample_depth
from scse_dist.train.depth_config import DepthSamplingConfig, largest_trained_depth


def draws(sampling, mean, n=3000, seed=0):
    return np.array([sample_depth(s, sampling, mean, seed) for s in range(n)])


def test_fixed_is_the_model_depth():
    assert set(draws(DepthSamplingConfig(kind="fixed"), 6, n=50)) == {6}


@pytest.mark.parametrize("kind", ["uniform", "poisson_lognormal"])
def test_same_seed_and_step_give_the_same_depth(kind):
    sampling = DepthSamplingConfig(kind=kind)
    a, b = draws(sampling, 4, n=200, seed=7), draws(sampling, 4, n=200, seed=7)
    assert (a == b).all()
    assert (a != draws(sampling, 4, n=200, seed=8)).any()  # the seed matters
    assert len(set(a)) > 3  # and the step does: not one constant


def test_uniform_covers_min_to_twice_the_mean_by_default():
    t = draws(DepthSamplingConfig(kind="uniform", min=2, max=0), 4)
    assert set(t) == set(range(2, 9))
    counts = np.bincount(t)[2:]
    assert counts.min() > 0.6 * len(t) / 7  # roughly flat


def test_uniform_explicit_max():
    assert set(draws(DepthSamplingConfig(kind="uniform", min=3, max=5), 4, n=500)) == {3, 4, 5}


def test_poisson_lognormal_mean_and_floor():
    t = draws(DepthSamplingConfig(kind="poisson_lognormal", min=1, sigma=0.5), 16)
    assert abs(t.mean() - 16) < 0.8  # E[T] = mean by construction (clipping at 1 is negligible)
    assert t.min() >= 1 and t.max() > 24  # heavy right tail
    floored = draws(DepthSamplingConfig(kind="poisson_lognormal", min=3, sigma=0.5), 4)
    assert floored.min() == 3


def test_poisson_lognormal_cap_when_max_set():
    t = draws(DepthSamplingConfig(kind="poisson_lognormal", min=1, max=6, sigma=1.0), 4, n=1000)
    assert t.max() == 6


@pytest.mark.parametrize("kw,mean,want", [
    (dict(kind="fixed"), 4, 4), (dict(kind="uniform"), 4, 8), (dict(kind="uniform", max=6), 4, 6),
    (dict(kind="poisson_lognormal"), 4, 8), (dict(kind="poisson_lognormal", max=32), 4, 32),
    (dict(kind="uniform", min=3, max=2), 1, 3)])
def test_largest_trained_depth(kw, mean, want):
    assert largest_trained_depth(DepthSamplingConfig(**kw), mean) == want


def test_largest_trained_depth_bounds_every_uniform_draw():
    sampling = DepthSamplingConfig(kind="uniform", min=2, max=0)
    assert draws(sampling, 4, n=500).max() == largest_trained_depth(sampling, 4)
