"""train.engine.compile: regional torch.compile of the blocks. One graph serves every block,
every loop step and every depth T (no recompilation when T changes), and it computes what eager
does (also under inductor, the CUDA backend)."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_dynamo(monkeypatch):
    # aot_eager traces forward and backward like inductor but skips its slow CPU codegen.
    monkeypatch.setenv("SCSE_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()  # Block._forward's cache is per code object: start from none
    counters.clear()
    yield
    torch._dynamo.reset()


def compiles() -> int:
    """Frames dynamo has converted (first compiles and recompiles alike)."""
    return counters["frames"]["total"]


def assert_same_step(eager, compiled, tokens, **forward) -> None:
    """One forward and backward of each model: the compiled one's loss and every gradient equal
    the eager one's."""
    losses = []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, tokens, keep_logits=False, **forward).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("ckpt", ["none", "block", "loop"])
def test_a_new_loop_depth_never_recompiles_and_matches_eager(fresh_dynamo, ckpt: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, n_prelude=1,
                      n_core=2, n_coda=1, depth=4, activation_checkpointing=ckpt)
    eager = LoopedLM(cfg)
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    rng = random.Random(0)
    depths = [rng.randint(2, 8) for _ in range(8)]
    assert len(set(depths)) >= 4
    no_recompile = contextlib.ExitStack()
    for step, depth in enumerate(depths):
        assert_same_step(eager, compiled, tokens, depth=depth)
        if step == 0:
            # The first call compiled Block._forward once for all four blocks; from here on any
            # recompilation (a new T, checkpoint recomputation) raises.
            assert compiles() == 1 and counters["stats"]["unique_graphs"] == 1
            no_recompile.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
    no_recompile.close()
    assert compiles() == 1


@pytest.mark.slow
def test_trainer_at_zero3_with_compile_matches_eager_without_recompiles(tmp_path, tiny_config,
                                                                         subprocess_env):
    # T drawn from 2..8; TORCH_LOGS makes dynamo report every recompilation and graph break (a
    # DeepSpeed hook traced inside a block gave both, before the blocks became ZeRO-3 leaves).
    env = dict(subprocess_env, SCSE_COMPILE_BACKEND="aot_eager",
               TORCH_LOGS="recompiles,graph_breaks")
    losses = {}
    for compile_ in ("true", "false"):
        (tmp_path / compile_).mkdir()
        cfg = tiny_config(tmp_path / compile_, f"train.engine.compile={compile_}",
                          "train.engine.zero_stage=3",
                          "train.max_steps=6", "train.log_every=1", "train.depth.min=2",
                          "train.depth.max=8", "train.checkpoint.every=6")
        out = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config", cfg],
                             capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "__recompiles" not in out.stderr and "__graph_breaks" not in out.stderr
        metrics = tmp_path / compile_ / "runs" / "tiny" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[compile_] = [r["loss"] for r in rows]
        assert len({r["depth"] for r in rows}) >= 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recurrence", ["scse", "looped"])
def test_inductor_matches_eager_with_loop_checkpointing_and_truncated_backprop(recurrence,
                                                                               monkeypatch):
    """The CUDA backend on CPU: train.engine.compile's inductor (the tests above use aot_eager),
    forward and backward, loop checkpointing recomputing compiled blocks, the last 2 of T steps
    backpropagated."""
    monkeypatch.setenv("SCSE_COMPILE_BACKEND", "inductor")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, n_prelude=1,
                      n_core=2, n_coda=1, depth=4, recurrence=recurrence,
                      activation_checkpointing="loop")
    eager = LoopedLM(cfg)
    compiled = copy.deepcopy(eager)
    compiled.compile_blocks()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for depth, backprop_steps in ((4, 2), (3, 0)):
        # measured: losses within 4.8e-7 (2.4e-7 relative), gradients within 5.2e-8
        assert_same_step(eager, compiled, tokens, depth=depth, backprop_steps=backprop_steps)
    torch._dynamo.reset()
