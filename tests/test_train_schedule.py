"""Warmup-cosine LR: exact values at warmup start/end, mid-cosine and the last step."""

import math

import pytest
import torch

from scse_dist.config import TrainConfig
from scse_dist.train.schedule import WarmupCosine, build_lr_scheduler


def test_multiplier_values():
    f = WarmupCosine(warmup_steps=10, max_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1)       # first update: lr / warmup
    assert f(4) == pytest.approx(0.5)
    assert f(9) == pytest.approx(1.0)       # end of warmup reaches the peak
    assert f(10) == pytest.approx(1.0)      # cosine starts at the peak
    assert f(59.5) == pytest.approx(0.55)   # half way: (1 + 0.1) / 2
    assert f(109) == pytest.approx(0.1)     # last step: min_lr_ratio exactly
    assert f(500) == pytest.approx(0.1)     # and it stays there


def test_no_warmup_starts_at_peak():
    f = WarmupCosine(warmup_steps=0, max_steps=5, min_ratio=0.0)
    assert [round(f(s), 6) for s in range(5)] == \
        [1.0, round(0.5 * (1 + math.cos(math.pi / 4)), 6), 0.5,
         round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6), 0.0]


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2e-3)
    sched = build_lr_scheduler(opt, TrainConfig(lr=2e-3, warmup_steps=4, max_steps=20,
                                                min_lr_ratio=0.25))
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4)
    assert lrs[3] == pytest.approx(2e-3)
    assert lrs[-1] == pytest.approx(5e-4)
    assert max(lrs) == pytest.approx(2e-3)
