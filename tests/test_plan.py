"""scse-train --plan: the numbers (hand arithmetic), the table, --json, and bad input in one line.

Memory comes from scse_dist.train.sizing, which tests/test_sizing.py checks against torch and a
real DeepSpeed engine; here the plan's own arithmetic: tokens, steps, time at the MFU, bytes sent
per step, what fits.
"""

from __future__ import annotations

import json

import pytest

from scse_dist.config import load_config
from scse_dist.model import flops_per_token
from scse_dist.train.cli import main
from scse_dist.train.plan import Assumptions, build, render
from scse_dist.train.sizing import (
    GIB,
    activation_memory,
    checkpointing_for,
    count_parameters,
    training_depths,
)

GPT2 = "configs/gpt2-small-scse.yaml"


def test_plan_arithmetic_on_16_h200_at_zero2():
    cfg = load_config(GPT2, ["train.engine.zero_stage=2", "train.depth.kind=fixed"])
    plan = build(cfg, 16, Assumptions(gpu="h200", mfu=0.25, tokens=1e9))
    n = count_parameters(cfg.model)
    tokens_per_step = 16 * 2 * 16 * 1024  # micro 16 x accum 2 x 16 GPUs: the config's 524288
    assert plan["tokens_per_step"] == tokens_per_step == cfg.train.batch.global_batch_tokens
    assert plan["steps"] == -(-10**9 // tokens_per_step) and plan["depth"]["max"] == 4
    step_flops = tokens_per_step * flops_per_token(cfg.model, 4, 1024)
    assert plan["seconds_per_step"] == pytest.approx(step_flops / 16 / (989e12 * 0.25))
    assert plan["seconds_run"] == pytest.approx(plan["seconds_per_step"] * plan["steps"])
    # ZeRO-2: a reduce-scatter per micro-batch (2) and one all-gather, bf16, (W-1)/W each
    assert plan["communication"]["bytes_per_step"] == pytest.approx(3 * n * 2 * 15 / 16)
    assert plan["communication"]["link_gbs"] == 50.0  # two nodes: the NIC, not NVLink
    assert plan["memory_bytes"]["training_state"] == pytest.approx(2 * n + 18 * n / 16, abs=1)
    assert plan["training_state_formula"].startswith("DeepSpeed estimate_zero2")


def test_largest_micro_batch_fits_and_one_more_does_not():
    cfg = load_config(GPT2, ["model.activation_checkpointing=none"])
    plan = build(cfg, 8, Assumptions(gpu="a100", memory_fraction=0.5))
    budget, state = plan["memory_bytes"]["budget"], plan["memory_bytes"]["training_state"]
    gpu = plan["memory_bytes"]["capacity"]  # the loss's chunks are sized for the GPU's memory
    deepest = max(training_depths(cfg.model, cfg.train))
    sections = cfg.model, cfg.data, cfg.train
    for mode, largest in plan["largest_micro_batch"].items():
        assert state + activation_memory(*sections, deepest, "bf16", largest, mode, gpu).total \
            <= budget
        assert state + activation_memory(*sections, deepest, "bf16", largest + 1, mode, gpu
                                         ).total > budget
    assert plan["largest_micro_batch"]["loop"] > plan["largest_micro_batch"]["none"]
    assert plan["fits"] == (plan["largest_micro_batch"]["none"] >= 16)


def test_auto_takes_the_largest_candidate_that_fits():
    cfg = load_config(GPT2, ["train.batch.micro_batch_size=auto",
                             "train.batch.global_batch_tokens=1048576",
                             "model.activation_checkpointing=none"])
    plan = build(cfg, 8, Assumptions(gpu="h100"))
    largest = plan["largest_micro_batch"]["none"]
    assert plan["micro_batch_candidates"] == [128, 64, 32, 16, 8, 4, 2, 1]
    assert plan["micro_batch"] == max(c for c in plan["micro_batch_candidates"] if c <= largest)
    assert plan["micro_batch"] * plan["grad_accum_steps"] * 8 == 1024


def test_auto_checkpointing_is_none_where_the_estimate_fits_else_loop():
    """gpt2-small-scse's auto on one GPU, micro-batch 16 at T = 16: none on an H100 (17.6 GiB
    of 72), loop where only 10 GiB may be filled (8.2 GiB with it); the trainer asks the same
    function with its device's memory (scse_dist.train.loop._checkpointing)."""
    cfg = load_config(GPT2, ["train.batch.global_batch_tokens=0", "train.batch.micro_batch_size=16",
                             "train.batch.grad_accum_steps=1"])
    assert cfg.model.activation_checkpointing == "auto"
    roomy = build(cfg, 1, Assumptions(gpu="h100"))
    need = roomy["memory_bytes"]["training_state"] + roomy["memory_bytes"]["activations"]["none"]
    assert roomy["activation_checkpointing"] == "none" and need <= roomy["memory_bytes"]["budget"]
    assert roomy["memory_bytes"]["peak"] == pytest.approx(need)
    tight = build(cfg, 1, Assumptions(gpu="h100", memory_fraction=10 * GIB / (81559 * 2**20)))
    assert tight["activation_checkpointing"] == "loop" and tight["fits"]
    h100 = roomy["memory_bytes"]["capacity"]  # the loss's chunks as sized on it
    sections = cfg.model, cfg.data, cfg.train
    assert checkpointing_for(*sections, 1, "bf16", need, h100) == "none"
    assert checkpointing_for(*sections, 1, "bf16", need - 1, h100) == "loop"
    fixed = load_config(GPT2, ["model.activation_checkpointing=block"])
    # only auto is chosen
    assert checkpointing_for(fixed.model, fixed.data, fixed.train, 1, "bf16", 1.0) == "block"


def test_table_and_json_through_the_cli(capsys, tiny_data):
    data = [f"data.path={tiny_data['path']}", f"data.tokenizer={tiny_data['tokenizer']}"]
    argv = ["--config", GPT2, "--plan", "--world-size", "16", "--gpu", "h200",
            "train.max_steps=500", *data]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.startswith("plan: gpt2-small-scse on 16 x H200 (2 nodes of 8), bf16, ZeRO-1")
    # the shipped batch, 0.5M tokens, split over the 16 GPUs
    assert "global batch 512 seq (524288 tokens) = micro 16 x accum 2 x world 16" in table
    for row in ("weights", "gradients", "optimizer state", "activations, no checkpointing",
                "activations, loop checkpointing", "peak per GPU", "largest micro-batch",
                "communication", "time per step", "time for the run", "assumptions:\n  40.0% MFU"):
        assert row in table, row
    assert "DeepSpeed has no estimator for ZeRO-1" not in table  # a note of the JSON only
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    expected = build(load_config(GPT2, ["train.max_steps=500", *data]), 16,
                     Assumptions(gpu="h200"))
    assert plan == json.loads(json.dumps(expected))
    assert plan["steps"] == 500 and plan["memory_bytes"]["peak"] / GIB < 140
    assert render(expected) + "\n" == table


@pytest.mark.parametrize("argv, line", [
    (["--plan", "--world-size", "16", "--gpu", "v100"],
     "--gpu: unknown GPU 'v100'; one of a100, h100, h200"),
    (["--plan", "--world-size", "24"],
     "train.batch.global_batch_tokens: 524288 (512 sequences of data.seq_len 1024) is not a "
     "multiple of train.batch.micro_batch_size (16) x world size (24, from --world-size)"),
    (["--plan", "--world-size", "8", "--mfu", "40"], "--mfu: a fraction in (0, 1], got 40.0"),
    (["--plan"], "--plan: needs --world-size (the GPUs the run trains on)"),
    (["--world-size", "8"], "--world-size: only with --plan or --dry-run"),
    (["--dry-run", "--world-size", "8", "--gpu", "h200"], "--gpu: only with --plan"),
    (["--dry-run", "--world-size", "0"], "--world-size: must be >= 1, got 0"),
    (["--json"], "--json: only with --plan"),
])
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys):
    assert main(["--config", GPT2, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"scse-train: config error: {line}"]
