"""train.depth.curriculum: the mean training depth ramps from `start` to model.depth over the
first `fraction` of train.max_steps (linear or 1-sqrt). Off, every kind draws what it drew
before, bit for bit; on, draws stay a pure function of (seed, step, config)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from scse_dist.config import load_config
from scse_dist.model import LoopedLM, flops_per_token
from scse_dist.model.config import ModelConfig
from scse_dist.train.depth import depth_mean, sample_depth
from scse_dist.train.depth_config import DepthCurriculumConfig, DepthSamplingConfig
from scse_dist.train.dry_run import describe
from scse_dist.train.sizing import training_depths
from scse_dist.typed_yaml import ConfigError


def ramped(shape="linear", start=1.0, fraction=0.5, **kw) -> DepthSamplingConfig:
    return DepthSamplingConfig(**kw, curriculum=DepthCurriculumConfig(shape, start, fraction))


# The draws of steps 0..11 at model.depth 4 before the curriculum existed, for seeds 0 and 7.
BEFORE = [
    (dict(kind="uniform", min=1, max=0), 0, [7, 5, 8, 5, 4, 6, 4, 7, 3, 3, 3, 2]),
    (dict(kind="uniform", min=1, max=0), 7, [8, 7, 3, 6, 5, 5, 8, 1, 8, 8, 8, 8]),
    (dict(kind="uniform", min=2, max=5), 0, [5, 4, 5, 4, 3, 4, 3, 5, 3, 3, 3, 2]),
    (dict(kind="uniform", min=2, max=5), 7, [5, 5, 3, 4, 4, 4, 5, 2, 5, 5, 5, 5]),
    (dict(kind="poisson_lognormal", min=1, sigma=0.5), 0, [1, 4, 2, 3, 4, 3, 3, 5, 2, 4, 2, 2]),
    (dict(kind="poisson_lognormal", min=1, sigma=0.5), 7, [5, 2, 4, 1, 5, 6, 7, 1, 3, 2, 2, 2]),
    (dict(kind="poisson_lognormal", min=2, max=12, sigma=1.0), 0,
     [2, 3, 2, 2, 2, 2, 2, 3, 2, 2, 2, 2]),
    (dict(kind="poisson_lognormal", min=2, max=12, sigma=1.0), 7,
     [3, 2, 4, 2, 6, 4, 12, 2, 3, 2, 2, 2]),
    (dict(kind="fixed"), 0, [4] * 12),
]


@pytest.mark.parametrize("kw,seed,want", BEFORE)
def test_off_draws_what_it_drew_before(kw, seed, want):
    sampling = DepthSamplingConfig(**kw)
    assert sampling.curriculum.shape == "none"
    assert [sample_depth(s, sampling, 4, seed) for s in range(12)] == want
    assert [sample_depth(s, sampling, 4, seed, 12) for s in range(12)] == want


@pytest.mark.parametrize("shape,half", [("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_the_mean_ramps_from_start_to_the_target_then_stays(shape, half):
    sampling = ramped(shape, start=2.0, fraction=0.25)  # 1000 steps: a ramp over 250
    mean = [depth_mean(s, sampling, 10, 1000) for s in range(1000)]
    assert mean[0] == 2.0
    assert mean[125] == pytest.approx(2.0 + 8 * half)
    assert mean[250] == 10.0 and set(mean[250:]) == {10.0}
    assert all(a < b for a, b in zip(mean[:250], mean[1:251]))  # rising all along the ramp
    off = DepthSamplingConfig()
    assert {depth_mean(s, off, 10, 1000) for s in (0, 125, 999)} == {10.0}


def test_one_minus_sqrt_starts_slower_than_linear():
    lin, slow = ramped("linear"), ramped("1-sqrt")
    for s in (10, 50, 90):
        assert depth_mean(s, slow, 9, 200) < depth_mean(s, lin, 9, 200)


def test_fixed_draws_the_rounded_mean():
    sampling = ramped("linear", start=1.0, fraction=0.5, kind="fixed")
    # the mean 1 + 7 s / 8 over 16 steps, rounded halves up
    assert [sample_depth(s, sampling, 8, 0, 16) for s in range(12)] == \
        [1, 2, 3, 4, 5, 5, 6, 7, 8, 8, 8, 8]


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
@pytest.mark.parametrize("kind", ["poisson_lognormal", "uniform"])
def test_draws_near_a_step_average_its_mean(kind, shape):
    sampling = ramped(shape, start=1.0, fraction=0.8, kind=kind, min=1, sigma=0.5)
    total, target = 20000, 16
    for s in (4000, 8000, 12000, 18000):
        window = range(s - 600, s + 600)
        got = np.mean([sample_depth(i, sampling, target, 3, total) for i in window])
        mean = np.mean([depth_mean(i, sampling, target, total) for i in window])
        if kind == "uniform":  # U{min, 2 * mean}: its mean is (1 + 2 mean) / 2
            mean = (1 + 2 * mean) / 2
        assert got == pytest.approx(mean, rel=0.06), s


def test_uniform_scales_its_upper_bound():
    sampling = ramped("linear", start=1.0, fraction=1.0, kind="uniform", min=1, max=12)
    # model.depth 6: at step 0 the mean is 1, so the bound is 12 * 1/6 = 2
    assert {sample_depth(0, sampling, 6, seed, 100) for seed in range(200)} == {1, 2}
    assert max(sample_depth(s, sampling, 6, 0, 100) for s in range(100, 400)) == 12


@pytest.mark.parametrize("kind", ["fixed", "uniform", "poisson_lognormal"])
def test_a_resume_draws_the_same_depths(kind):
    """A pure function of (seed, step, config): a run stopped at step 37 and resumed in a fresh
    state (other draws in between, the global RNGs moved) draws what the uninterrupted run does."""
    sampling = ramped("1-sqrt", start=1.0, fraction=0.5, kind=kind)
    whole = [sample_depth(s, sampling, 8, 5, 100) for s in range(100)]
    first = [sample_depth(s, sampling, 8, 5, 100) for s in range(37)]
    np.random.seed(1)
    np.random.rand(10)
    torch.rand(10)
    [sample_depth(s, sampling, 8, 6, 100) for s in range(50)]
    assert first + [sample_depth(s, sampling, 8, 5, 100) for s in range(37, 100)] == whole
    assert whole[:10] != [sample_depth(s, DepthSamplingConfig(kind=kind), 8, 5) for s in range(10)]


def test_the_curriculum_needs_the_step_count():
    with pytest.raises(ValueError, match="train.depth.curriculum needs total_steps"):
        sample_depth(0, ramped(), 4, 0)


def test_a_ramped_depth_below_backprop_steps_backpropagates_every_step():
    """backprop_steps k keeps gradients through the last k loop steps; a ramped T < k has all
    of its T steps backpropagated: the full gradient, and full FLOPs."""
    sampling = ramped("linear", start=1.0, fraction=0.5, kind="fixed", backprop_steps=4)
    depth = sample_depth(3, sampling, 8, 0, 20)  # the mean 1 + 7 * 3/10
    assert depth == 3 < sampling.backprop_steps
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=16, n_prelude=1,
                      n_core=1, n_coda=1, recurrence="scse", depth=8)
    model = LoopedLM(cfg)
    toks = torch.randint(0, 64, (2, 16))

    def grads(k):
        model.zero_grad()
        model(toks[:, :-1], toks[:, 1:], depth=depth, backprop_steps=k).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, trunc = grads(0), grads(sampling.backprop_steps)
    assert full.keys() == trunc.keys() and all(torch.equal(full[n], trunc[n]) for n in full)
    assert flops_per_token(cfg, depth, 16, 4) == flops_per_token(cfg, depth, 16, 0)
    assert flops_per_token(cfg, 8, 16, 4) < flops_per_token(cfg, 8, 16, 0)  # past the ramp


@pytest.mark.parametrize("override,message", [
    ("train.depth.curriculum.shape=cosine",
     "train.depth.curriculum.shape: must be one of none, linear, 1-sqrt"),
    ("train.depth.curriculum.start=0.5",
     "train.depth.curriculum.start: must be a finite number >= 1, got 0.5"),
    ("train.depth.curriculum.start=.inf",
     "train.depth.curriculum.start: must be a finite number >= 1, got inf"),
    ("train.depth.curriculum.fraction=0", "train.depth.curriculum.fraction: must lie in (0, 1]"),
    ("train.depth.curriculum.fraction=1.5",
     "train.depth.curriculum.fraction: must lie in (0, 1], got 1.5"),
])
def test_bad_curriculum_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_dry_run_mean_and_flops_follow_the_ramp():
    base = ["model.depth=8", "train.depth.kind=fixed", "train.max_steps=16"]
    flat = load_config(None, base)
    cfg = load_config(None, [*base, "train.depth.curriculum.shape=linear",
                             "train.depth.curriculum.fraction=0.5"])
    # the ramp 1, 2, 3, 4, 5, 5, 6, 7, then 8 for the last 8 steps: mean 97 / 16 = 6.0625
    assert training_depths(cfg.model, cfg.train) == [1, 2, 3, 4, 5, 5, 6, 7] + [8] * 8
    assert "training depth T (fixed): min 1, mean 6.06, max 8" in describe(cfg, world_size=1)
    assert "training depth T (fixed): min 8, mean 8.00, max 8" in describe(flat, world_size=1)
    assert training_depths(cfg.model, cfg.train, 32) == \
        [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 5, 6, 6, 7, 7, 8] + [8] * 16

    def total(c):
        line = [x for x in describe(c, world_size=1).splitlines() if "FLOPs in all" in x]
        return float(line[0].rsplit(" ", 1)[1])

    assert total(cfg) < 0.85 * total(flat)
