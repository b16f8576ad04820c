"""ZeRO-1/2/3 on 2 real ranks against 1 rank at the same global batch, and the global-batch config.

Both runs use sampled depth (T uniform in 1..4) and loop activation checkpointing, so the ZeRO-3
run also covers the loop leaf with a T that changes every step. fp32 on CPU; the stated
tolerance is 1e-5 absolute on every step's loss and on every consolidated parameter (measured:
at most 4.8e-7 on a loss and 1.2e-7 on a parameter over the 20 steps, all three stages).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from scse_dist.config import config_from_dict, config_to_dict, load_config
from scse_dist.distributed import free_port
from scse_dist.train.batch_config import BatchConfig
from scse_dist.typed_yaml import ConfigError
from train_procs import REPO, TRAIN, all_passed, run_ranks

TOL = 1e-5
PARITY = ("-m", "scse_dist.train.parity")
OVERRIDES = ("train.batch.global_batch_size=8", "train.batch.micro_batch_size=4",
             "train.max_steps=20",
             "train.depth.max=4", "model.activation_checkpointing=loop")


def load_stage(out, stage):
    d = out / f"stage{stage}"
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    return json.loads((d / "losses.json").read_text()), load_file(str(d / "model.safetensors")), cfg


@pytest.mark.slow
def test_zero_stages_on_two_ranks_match_one_rank_at_the_same_global_batch(tmp_path, tiny_config,
                                                                          subprocess_env):
    cfg = tiny_config(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run([sys.executable, *PARITY, "--config", cfg, "--out", str(one),
                             "--stages", "1", *OVERRIDES], env=subprocess_env, cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    all_passed(run_ranks([*PARITY, "--config", cfg, "--out", str(two), "--stages", "1,2,3",
                          *OVERRIDES], subprocess_env))

    ref_losses, ref_params, ref_cfg = load_stage(one, 1)
    assert ref_cfg["train"]["batch"]["grad_accum_steps"] == 2  # 8 = 4 x 1 rank x 2
    assert ref_losses[-1] < ref_losses[0] - 0.5  # the curve moves: 5.77 -> 4.69 measured
    for stage in (1, 2, 3):
        losses, params, run_cfg = load_stage(two, stage)
        assert run_cfg["train"]["batch"]["grad_accum_steps"] == 1  # 8 = 4 x 2 ranks x 1
        assert run_cfg["train"]["engine"]["zero_stage"] == stage
        assert len(losses) == 20
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, stage
        assert params.keys() == ref_params.keys()
        for key, want in ref_params.items():
            assert torch.allclose(params[key], want, rtol=0, atol=TOL), (stage, key)


def test_global_batch_derives_grad_accumulation_per_world_size():
    t = BatchConfig(micro_batch_size=4, global_batch_size=32)
    assert [t.grad_accum_for(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert BatchConfig(micro_batch_size=4, grad_accum_steps=3).grad_accum_for(5) == 3  # unset
    with pytest.raises(ConfigError, match=r"train.batch.global_batch_size: 32 is not a multiple of "
                                          r"train.batch.micro_batch_size \(4\) x world size \(3\)"):
        t.grad_accum_for(3)
    with pytest.raises(ConfigError, match="train.batch.grad_accum_steps: 2 contradicts train.batch."
                                          "global_batch_size=32, which needs 4 at world size 2"):
        BatchConfig(micro_batch_size=4, global_batch_size=32, grad_accum_steps=2).grad_accum_for(2)


def test_global_batch_tokens_is_whole_sequences_of_seq_len_kept_at_every_world_size(
        tmp_path, tiny_config):
    # 32 x 32 tokens
    cfg = load_config(tiny_config(tmp_path, "train.batch.global_batch_tokens=1024"))
    t = cfg.train
    assert (t.batch.global_batch_size, t.batch.global_batch_tokens) == (32, 1024)
    assert [t.batch.grad_accum_for(w) for w in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert t.batch.batch_derivation(32, 2) == \
        "global batch 32 seq (1024 tokens) = micro 4 x accum 4 x world 2"
    # a run's config.yaml holds both, in agreement: it loads back the same
    assert config_from_dict(config_to_dict(cfg)) == cfg
    # another data.seq_len keeps the tokens: fewer, longer sequences
    assert load_config(tiny_config(tmp_path, "train.batch.global_batch_tokens=1024",
                                   "data.seq_len=16")).train.batch.global_batch_size == 64
    assert BatchConfig(micro_batch_size=4, grad_accum_steps=2).batch_derivation(32, 3) == (
        "global batch 24 seq (768 tokens) = micro 4 x accum 2 x world 3 "
        "(train.batch.global_batch_size unset: the batch grows with the world size)")
    with pytest.raises(ConfigError, match=r"^train.batch.global_batch_tokens: 1024 \(32 "
                                          r"sequences of data.seq_len 32\) is not a multiple of "
                                          r"train.batch.micro_batch_size \(4\) x world size "
                                          r"\(3, from --world-size\)$"):
        t.batch.grad_accum_for(3, world_from="from --world-size")


@pytest.mark.parametrize("overrides, line", [
    (["train.batch.global_batch_tokens=1000"],
     "train.batch.global_batch_tokens: 1000 is not a multiple of data.seq_len (32), so it is no "
     "whole number of sequences"),
    (["train.batch.global_batch_tokens=1024", "train.batch.global_batch_size=16"],
     "train.batch.global_batch_size: 16 contradicts train.batch.global_batch_tokens=1024 (32 "
     "sequences of data.seq_len 32); give one of them, the other 0"),
    (["train.batch.global_batch_tokens=-32"],
     "train.batch.global_batch_tokens: must be >= 0, got -32"),
])
def test_a_bad_global_batch_in_tokens_is_one_line_naming_the_fields(tmp_path, tiny_config,
                                                                     overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_config(tmp_path, *overrides))
    assert str(err.value) == f"{line} (in {tmp_path / 'tiny.yaml'})"


@pytest.mark.parametrize("batch, named", [
    ("train.batch.global_batch_size=12", "train.batch.global_batch_size: 12"),
    ("train.batch.global_batch_tokens=384", "train.batch.global_batch_tokens: 384 (12 sequences of "
                                      "data.seq_len 32)"),
])
def test_indivisible_global_batch_exits_2_before_any_process_group(tmp_path, tiny_config,
                                                                   subprocess_env, batch, named):
    cfg = tiny_config(tmp_path, batch)
    # Rank 0 of a world of 2 whose peer never comes: a started process group would hang here.
    env = dict(subprocess_env, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), SCSE_DIST_TIMEOUT_S="60")
    out = subprocess.run([sys.executable, TRAIN, "--config", cfg], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"scse-train: config error: {named} is not a multiple of "
                                  "train.batch.micro_batch_size (4) x world size (2, from "
                                  "WORLD_SIZE)")
    assert not (tmp_path / "runs").exists()


def test_train_refuses_an_indivisible_batch_before_the_process_group(tmp_path, tiny_config,
                                                                     monkeypatch):
    """train() called in-process (scse-launch --local, a study's --local): the same line, and
    no process group was started."""
    import torch.distributed as dist

    from scse_dist.train.loop import train

    # a started group would wait for its 2 missing peers (here at most 10 s, then fail otherwise)
    for key, value in {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_JOB_ID": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "SCSE_DIST_TIMEOUT_S": "10"}.items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(tiny_config(tmp_path, "train.batch.global_batch_size=16"))
    with pytest.raises(ConfigError, match=r"^train.batch.global_batch_size: 16 is not a multiple "
                                          r"of train.batch.micro_batch_size \(4\) x world size "
                                          r"\(3, from SLURM_STEP_NUM_TASKS\)$"):
        train(cfg)
    assert not dist.is_initialized() and not (tmp_path / "runs").exists()


def test_train_reads_shards_and_builds_no_data(tmp_path, tiny_config, monkeypatch):
    """The corpus build is the data step that scse-train runs before train(): train() itself,
    with data.build set and no shards there, refuses (66) and writes no corpus or tokenizer."""
    from scse_dist.cli_errors import exit_status
    from scse_dist.train.loop import train

    # the process group train() starts exports these: restored after the test
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    data = tmp_path / "data"
    cfg = load_config(tiny_config(tmp_path, f"data.path={data}/shards", "train.max_steps=1",
                                  f"data.tokenizer={data}/tokenizer.model",
                                  "data.build=stdlib_docs", "data.build_vocab_size=512",
                                  "model.vocab_size=512"))
    with pytest.raises(FileNotFoundError, match="tokenizer.model") as err:
        train(cfg)
    assert exit_status(err.value) == 66
    assert not data.exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_accumulation_of_4_micro_batches_of_2_equals_1_of_8_at_every_zero_stage(tmp_path,
                                                                                tiny_config,
                                                                                subprocess_env):
    """The trainer's own train_step on 2 ranks: 4 x micro-batch 2 and 1 x micro-batch 8 see the
    same global batch of 16 (in another split over ranks and micro-batches), so DeepSpeed's
    per-micro-batch loss scaling must make every step's loss and the final parameters agree."""
    cfg = tiny_config(tmp_path)
    common = ("train.max_steps=10", "train.depth.max=4", "train.batch.global_batch_size=16")
    runs = {"accum4": ("train.batch.micro_batch_size=2",),
            "accum1": ("train.batch.micro_batch_size=8",)}
    for name, overrides in runs.items():
        all_passed(run_ranks([*PARITY, "--config", cfg, "--out", str(tmp_path / name),
                              "--stages", "0,1,2,3", *common, *overrides], subprocess_env))
    for stage in (0, 1, 2, 3):
        losses4, params4, cfg4 = load_stage(tmp_path / "accum4", stage)
        losses1, params1, cfg1 = load_stage(tmp_path / "accum1", stage)
        accums = (cfg4["train"]["batch"]["grad_accum_steps"],
                  cfg1["train"]["batch"]["grad_accum_steps"])
        assert accums == (4, 1)
        assert len(losses4) == len(losses1) == 10
        # it trains, so the comparison means something
        assert losses4[-1] < losses4[0] - 0.3, losses4
        assert max(abs(a - b) for a, b in zip(losses4, losses1)) <= TOL, (stage, losses4, losses1)
        assert params4.keys() == params1.keys()
        for key, want in params1.items():
            assert torch.allclose(params4[key], want, rtol=0, atol=TOL), (stage, key)
