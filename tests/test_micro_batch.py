"""train.batch.micro_batch_size: auto (scse_dist.train.micro_batch): the candidates, the chooser
with a fake "fits", the CPU memory measure on real allocations, a probe that changes nothing, and
the trainer end to end: a small budget picks a smaller micro-batch whose losses are bit-identical to
the same micro-batch configured by hand.

Measured on the tests' tiny model (d 32, vocab 320, 32 tokens, T=3): a probe's peak RSS grows
about 0.95 MiB per sequence (15.0-15.1 MiB at 16, 30.4-31.4 MiB at 32, repeatable to ~2 MiB), so
a 24 MiB budget takes 16 of 64 with room on both sides.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from scse_dist.config import load_config
from scse_dist.train import micro_batch as mb
from scse_dist.train.batch_config import BatchConfig
from scse_dist.typed_yaml import ConfigError
from train_procs import TRAIN

MIB = 2**20


def test_candidates_are_the_powers_of_two_dividing_the_rank_share_largest_first():
    t = BatchConfig(micro_batch_size="auto", global_batch_size=96)
    assert t.micro_batch_candidates(1) == [32, 16, 8, 4, 2, 1]
    assert t.micro_batch_candidates(2) == [16, 8, 4, 2, 1]
    assert t.micro_batch_candidates(32) == [1]
    assert t.grad_accum_for(2) == 3  # before the choice: at the largest candidate
    assert t.grad_accum_for(2, 4) == 12
    with pytest.raises(ConfigError, match=r"^train.batch.global_batch_size: 96 is not a multiple "
                                          r"of the world size \(5\)"):
        t.micro_batch_candidates(5)


def test_chooser_takes_the_largest_that_fits_and_probes_nothing_smaller():
    asked = []

    def why_not(size):
        asked.append(size)
        return None if size <= 8 else "ran out of memory"

    assert mb.choose([64, 32, 16, 8, 4, 2, 1], why_not) == mb.Choice(8, (16, "ran out of memory"))
    assert asked == [64, 32, 16, 8]
    assert mb.choose([4, 2, 1], lambda size: None) == mb.Choice(4, None)
    assert mb.choose([2, 1], lambda size: "too big") == mb.Choice(0, (1, "too big"))


def test_peak_rss_growth_sees_an_allocation_freed_before_it_returns():
    def allocate():
        block = np.ones(64 * MIB, dtype=np.uint8)  # written: resident, not just reserved
        del block

    growth = mb.peak_rss_growth(allocate)
    assert 60 * MIB <= growth <= 72 * MIB, growth / MIB
    assert mb.peak_rss_growth(lambda: None) < 4 * MIB  # the peak was reset, not the old one


def test_cpu_budget_measures_each_candidate_and_never_runs_one_far_over_it():
    ran = []

    def run(size):  # 4 MiB per sequence, like activations
        ran.append(size)
        block = np.ones(size * 4 * MIB, dtype=np.uint8)
        del block

    budget = mb.CpuBudget(run, budget=20 * MIB, reserve=0)
    choice = mb.choose([64, 32, 16, 8, 4, 2, 1], budget.why_not)
    assert choice.size == 4
    assert choice.refused[0] == 8 and choice.refused[1].startswith("needs 0.03")
    assert choice.refused[1].endswith("of the 0.0195 GiB budget")
    # 64, 32 and 16 were refused on the line through 1 and 2 (over twice the budget): never run.
    assert ran == [2, 1, 8, 4]


def tiny_cfg(tiny_config, tmp_path, *overrides):
    return load_config(tiny_config(tmp_path, "train.batch.micro_batch_size=auto",
                                   "train.batch.global_batch_size=64", "train.depth.max=3",
                                   *overrides))


def test_a_probe_leaves_weights_gradients_and_every_rng_stream_as_they_were(tiny_config, tmp_path):
    from scse_dist.model import LoopedLM

    cfg = tiny_cfg(tiny_config, tmp_path)
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    mb.probe(model, 8, cfg.data, cfg.train, depth=3, device=torch.device("cpu"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    draws = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    assert draws == (random.random(), np.random.rand(), torch.rand(()).item())


def test_find_micro_batch_on_cpu_picks_what_fits_the_budget_and_says_why(tiny_config, tmp_path):
    from scse_dist.model import LoopedLM

    cfg = tiny_cfg(tiny_config, tmp_path, f"train.batch.micro_batch_memory_gib={24 / 1024}")
    model = LoopedLM(cfg.model)
    size, line = mb.find_micro_batch(cfg.train, cfg.data, model, 1, 1, torch.device("cpu"))
    assert size == 16, line
    assert line.startswith("micro-batch auto: 16 (32 needs 0.0")
    assert line.endswith("of the 0.0234 GiB budget) at T=3 under a CPU budget of 0.0234 GiB; "
                         "grad_accum_steps 4 for global batch 64 at world size 1")


def test_auto_config_parses_and_rejects_in_one_line(tiny_config, tmp_path):
    assert tiny_cfg(tiny_config, tmp_path).train.batch.micro_batch_size == "auto"
    assert load_config(tiny_config(tmp_path, "train.batch.micro_batch_size=16")
                       ).train.batch.micro_batch_size == 16
    bad = {("train.batch.micro_batch_size=auto",):
           "train.batch.micro_batch_size: auto needs train.batch.global_batch_size",
           ("train.batch.micro_batch_size=big",):
           "train.batch.micro_batch_size: expected an integer or 'auto', got 'big'",
           ("train.batch.micro_batch_size=auto", "train.batch.global_batch_size=64",
            "train.batch.grad_accum_steps=2"):
           "train.batch.grad_accum_steps: 2 with train.batch.micro_batch_size: auto, which "
           "derives it",
           ("train.batch.micro_batch_memory_gib=-1",):
           "train.batch.micro_batch_memory_gib: must be >= 0"}
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config(tiny_config(tmp_path, *overrides))
        assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


@pytest.mark.slow
def test_auto_under_a_small_budget_trains_bit_identically_to_the_same_micro_batch_by_hand(
        tmp_path, tiny_config, subprocess_env):
    common = ("train.batch.global_batch_size=64", "train.depth.max=3", "train.max_steps=6",
              "train.log_every=1", "train.checkpoint.every=6")
    runs = {"auto": ("train.batch.micro_batch_size=auto",
                     f"train.batch.micro_batch_memory_gib={24 / 1024}"),
            "fixed": ("train.batch.micro_batch_size=16",)}
    out = {}
    for name, overrides in runs.items():
        (tmp_path / name).mkdir()
        cfg = tiny_config(tmp_path / name, f"name={name}", *common, *overrides)
        proc = subprocess.run([sys.executable, TRAIN, "--config", cfg], env=subprocess_env,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = proc.stdout
    assert "micro-batch auto: 16 (32 needs" in out["auto"]
    assert "grad_accum_steps 4 for global batch 64 at world size 1" in out["auto"]
    assert "micro-batch auto" not in out["fixed"]
    auto, fixed = _losses(tmp_path / "auto/runs/auto"), _losses(tmp_path / "fixed/runs/fixed")
    assert len(auto) == 6 and auto == fixed  # every step's loss, bit for bit


def test_dry_run_counts_auto_at_its_largest_candidate(tiny_config, tmp_path, monkeypatch):
    from scse_dist.train.dry_run import describe

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    report = describe(tiny_cfg(tiny_config, tmp_path))
    assert "global batch 64 seq (2048 tokens) = micro 64 x accum 1 x world 1 (micro-batch auto: " \
           "at most 64; the probe at start-up may take less and accumulate more)" in report
    assert "global batch 64 seq (2048 tokens) = micro 32 x accum 1 x world 2 (micro-batch auto: " \
           "at most 32;" in describe(tiny_cfg(tiny_config, tmp_path, "train.max_steps=3"),
                                     world_size=2)


AGREE = """
import os, torch
from scse_dist.distributed import init_distributed, shutdown
from scse_dist.train.micro_batch import agree
env = init_distributed()
print("agreed", agree([16, 8][env.rank], torch.device("cpu")))
shutdown()
"""


@pytest.mark.slow
def test_ranks_agree_on_the_smallest_choice(subprocess_env):
    from train_procs import run_ranks

    results = run_ranks(["-c", AGREE], subprocess_env, world=2, timeout=120)
    assert [r.returncode for r in results] == [0, 0], results[0].tail() + results[1].tail()
    assert [r.stdout.split()[-1] for r in results] == ["8", "8"]


@pytest.mark.slow
def test_auto_on_two_ranks_splits_the_rank_share_and_trains(tmp_path, tiny_config, subprocess_env):
    from train_procs import all_passed, train_ranks

    cfg = tiny_config(tmp_path, "train.batch.micro_batch_size=auto",
                      "train.batch.global_batch_size=64", "train.depth.max=3", "train.max_steps=2",
                      f"train.batch.micro_batch_memory_gib={12 / 1024}")
    results = train_ranks(cfg, subprocess_env)
    stdout = all_passed(results)
    assert "micro-batch auto: 8 (16 needs" in stdout, stdout
    assert "grad_accum_steps 4 for global batch 64 at world size 2" in stdout
    assert "micro-batch auto" not in results[1].stdout  # rank 0 says it once


@pytest.mark.slow
def test_a_resume_may_choose_another_micro_batch(tmp_path, tiny_config, subprocess_env):
    """The config saved in the run dir names what this start chose (its accumulation too); the
    resumed run, given auto again, probes again and continues."""
    cfg = tiny_config(tmp_path, "train.batch.micro_batch_size=auto",
                      "train.batch.global_batch_size=64", "train.depth.max=3",
                      "train.checkpoint.every=2", "train.log_every=1")
    outs = []
    for steps, budget_mib in ((2, 24), (4, 12)):
        proc = subprocess.run([sys.executable, TRAIN, "--config", cfg, f"train.max_steps={steps}",
                               f"train.batch.micro_batch_memory_gib={budget_mib / 1024}"],
                              env=subprocess_env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)
    assert "micro-batch auto: 16 (" in outs[0] and "steps 0..2" in outs[0]
    assert "micro-batch auto: 8 (16 needs" in outs[1] and "steps 2..4" in outs[1]
    assert "grad_accum_steps 8 for global batch 64" in outs[1]
    from scse_dist.config import load_saved_config

    saved = load_saved_config(tmp_path / "runs/tiny/config.yaml").train.batch
    assert (saved.micro_batch_size, saved.grad_accum_steps) == (8, 8)
    assert [step for step, _ in _losses(tmp_path / "runs/tiny")] == [1, 2, 3, 4]
