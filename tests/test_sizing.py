"""scse_dist.train.sizing: the memory model against what torch and DeepSpeed really hold.

Activations: the bytes of every tensor autograd saves (saved_tensors_hooks, parameters left
out) against activation_memory().saved, exactly countable in-process. Training state at ZeRO-2
bf16: DeepSpeed's own estimator. The whole model (slow): a real DeepSpeed engine's peak RSS
growth over a training step on CPU (tests/memory_probe.py) within 15% of states + activations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from scse_dist.config import load_config
from scse_dist.train.sizing import (
    activation_memory,
    count_parameters,
    deepspeed_estimate,
    state_memory,
)

SMALL = ["model.d_model=64", "model.n_heads=2", "model.max_seq_len=64", "data.seq_len=64",
         "model.vocab_size=512", "model.depth=3"]


def saved_bytes(cfg, batch: int) -> int:
    """Bytes of the distinct storages autograd saves in one forward (not the parameters')."""
    from scse_dist.model import LoopedLM

    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len + 1))
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens[:, :-1], tokens[:, 1:], depth=cfg.model.depth, keep_logits=False,
              backprop_steps=cfg.train.depth.backprop_steps)
    return sum(seen.values())


@pytest.mark.parametrize("extra", [
    [], ["model.n_prelude=2", "model.n_core=2"], ["model.recurrence=looped"],
    ["model.recurrence=additive"], ["model.anchor_scale=core_norm"], ["model.inject=concat"],
    ["train.depth.backprop_steps=1"], ["model.n_heads=4", "model.n_kv_heads=1"],
    ["model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=24"]])
def test_saved_activations_match_the_count(extra):
    cfg = load_config(None, SMALL + extra + ["model.activation_checkpointing=none"])
    planned = activation_memory(cfg.model, cfg.data, cfg.train, cfg.model.depth, "fp32", 4).saved
    assert saved_bytes(cfg, 4) == pytest.approx(planned, rel=0.02)


def test_zero2_bf16_state_is_deepspeeds_estimate():
    for world, per_node in ((1, 8), (8, 8), (16, 8), (64, 4)):
        ds, name = deepspeed_estimate(123_456_789, 2, world, per_node, 0)
        ours = state_memory(123_456_789, "bf16", 2, world).total
        assert ours == pytest.approx(ds, abs=1) and "zero2" in name


def test_state_memory_shards_by_stage():
    p, n = 1000, 4
    assert state_memory(p, "bf16", 0, n).total == 20 * p  # 2 + 2 + 4 + 4 + 8
    assert state_memory(p, "bf16", 1, n).total == 2 * p + 2 * p + 16 * p / n
    assert state_memory(p, "bf16", 3, n, max_live=10**9).total == 20 * p / n + 2 * p
    assert state_memory(p, "bf16", 3, n, max_live=100).total == 20 * p / n + 2 * 100
    assert state_memory(p, "fp32", 0, 1).total == 16 * p
    assert state_memory(p, "fp32", 1, n).total == 4 * p + 4 * p + 12 * p / n


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["train.engine.zero_stage=1", "model.activation_checkpointing=none"],
    ["train.engine.zero_stage=2", "model.activation_checkpointing=loop", "model.vocab_size=16384"],
])
def test_a_real_engine_peak_is_within_15_percent_of_the_plan(extra, subprocess_env):
    overrides = ["model.d_model=128", "model.n_heads=4", "model.max_seq_len=256",
                 "data.seq_len=256", "model.vocab_size=512", "model.depth=4",
                 "train.batch.micro_batch_size=8", "train.engine.precision=fp32", *extra]
    env = dict(subprocess_env, MALLOC_MMAP_THRESHOLD_="65536", WORLD_SIZE="1", RANK="0",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 500))
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "memory_probe.py"), *overrides],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = load_config(None, overrides)
    states = state_memory(count_parameters(cfg.model), "fp32", cfg.train.engine.zero_stage, 1).total
    planned = states + activation_memory(cfg.model, cfg.data, cfg.train, 4, "fp32", 8).total
    assert measured["peak"] == pytest.approx(planned, rel=0.15), (measured, states, planned)
