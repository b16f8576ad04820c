"""`scse-train --dry-run`: what a config would do, from the config alone, without doing any of it.

Prints the parameter count (the model built on torch's meta device: no memory, no weights), the
depths the run will draw (train.depth sampling is a pure function of seed and step) and their
training FLOPs per token (scse_dist.model.flops), the tokens it will see, and a rough memory
estimate per rank. Creates nothing: no run dir, no data build, no process group, no DeepSpeed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.config import RunConfig
from scse_dist.model.transitions import transition_for

GIB = 2**30
# Bytes per parameter of each training state under mixed precision as DeepSpeed keeps them (fp32
# master weights, Adam's two moments) and under fp32; ZeRO stage k shards the first k kinds.
STATE_BYTES = {"bf16": {"optimizer": 4 + 8, "gradients": 2, "weights": 2},
               "fp32": {"optimizer": 8, "gradients": 4, "weights": 4}}
SHARDED_BY_STAGE = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"),
                    3: ("optimizer", "gradients", "weights")}


def training_depths(cfg: RunConfig) -> list[int]:
    """The depth T of every step of the run (a loop's sampled ones; a fixed stack has one)."""
    from scse_dist.train.depth import sample_depth

    fixed = transition_for(cfg.model).fixed_depth
    if fixed is not None:
        return [fixed] * cfg.train.max_steps
    t = cfg.train
    return [sample_depth(step, t.depth, cfg.model.depth, t.seed) for step in range(t.max_steps)]


def state_bytes(n_params: int, precision: str, zero_stage: int, world_size: int) -> float:
    """Weights, gradients and optimizer state of one rank."""
    per_kind = STATE_BYTES[precision]
    sharded = SHARDED_BY_STAGE[zero_stage]
    return sum(n_params * b / (world_size if kind in sharded else 1) for kind, b in per_kind.items())


def activation_bytes(cfg: RunConfig, depth: int, precision: str, micro_batch: int) -> float:
    """Rough activations of one micro-batch kept for backward at loop depth `depth`.

    Per block run, about 34 values per token and channel plus the attention scores (5 per head
    and key position: Korthikanti et al. 2022, at 2 bytes each in 16-bit), or only the block's
    input under activation checkpointing; plus the logits and their gradient in fp32."""
    m, t = cfg.model, cfg.train
    tokens = micro_batch * cfg.data.seq_len
    width = 2 if precision == "bf16" else 4
    per_block = tokens * m.d_model * (34 + 5 * m.n_heads * cfg.data.seq_len / m.d_model) * width / 2
    if m.activation_checkpointing:
        per_block = tokens * m.d_model * width
    calls = transition_for(m).core_calls(depth)
    if t.depth.backprop_steps:
        calls = min(calls, t.depth.backprop_steps + 1)
    blocks = m.n_prelude + m.n_core * calls + m.n_coda
    return blocks * per_block + 2 * tokens * m.vocab_size * 4


def count_parameters(cfg: RunConfig) -> int:
    import torch

    from scse_dist.model import LoopedLM

    with torch.device("meta"):  # shapes only: any size counts in milliseconds
        return LoopedLM(cfg.model).num_parameters()


def describe(cfg: RunConfig, config_path: Optional[str] = None,
             overrides: Sequence[str] = ()) -> str:
    """The dry run's report, one fact per line, at the launcher's world size."""
    from scse_dist.distributed import resolve_dist_env
    from scse_dist.model import flops_per_token
    from scse_dist.train.engine import resolve_precision

    world_size = resolve_dist_env(os.environ).world_size

    t, seq_len = cfg.train, cfg.data.seq_len
    accum = t.grad_accum_for(world_size)
    # auto: its largest candidate, the most it may take (the probe at start-up may take less)
    micro = t.micro_batch_candidates(world_size)[0] if t.micro_batch_size == "auto" \
        else t.micro_batch_size
    tokens_per_step = world_size * micro * accum * seq_len
    depths = training_depths(cfg)
    flops = [flops_per_token(cfg.model, d, seq_len) for d in depths]
    n_params = count_parameters(cfg)
    precision = resolve_precision(t.precision)
    states = state_bytes(n_params, precision, t.zero_stage, world_size)
    activations = activation_bytes(cfg, max(depths, default=cfg.model.depth), precision, micro)
    mean = sum(flops) / len(flops) if flops else 0.0
    lines = [
        f"dry run of {cfg.name}: nothing is created (run dir {Path(cfg.output_dir) / cfg.name})",
        f"parameters: {n_params:,}",
        f"world size {world_size}: {micro}{' (auto: at most)' if micro != t.micro_batch_size else ''}"
        f" sequences x {accum} accumulation x "
        f"{world_size} ranks x {seq_len} tokens = {tokens_per_step:,} tokens per step",
        f"steps: {t.max_steps:,}, tokens the run will see: {t.max_steps * tokens_per_step:,}",
        f"training depth T ({t.depth.kind}): min {min(depths, default=0)}, mean "
        f"{sum(depths) / max(1, len(depths)):.2f}, max {max(depths, default=0)}",
        f"training FLOPs per token (forward + backward): {mean:.3e} at the mean over steps, "
        + ", ".join(f"{flops_per_token(cfg.model, d, seq_len):.3e} at T={d}"
                    for d in sorted({min(depths), max(depths)}) if depths),
        f"training FLOPs in all: {sum(flops) * tokens_per_step:.3e}",
        f"memory per rank (rough): {(states + activations) / GIB:.2f} GiB = weights, gradients "
        f"and optimizer state {states / GIB:.2f} GiB ({precision}, ZeRO-{t.zero_stage}) + "
        f"activations of one micro-batch at T={max(depths, default=0)} {activations / GIB:.2f} GiB",
        f"data: {cfg.data.path} ({data_status(cfg, config_path, overrides)})",
    ]
    return "\n".join(lines)


def data_status(cfg: RunConfig, config_path: Optional[str], overrides: Sequence[str]) -> str:
    """What the run's data checks (scse_dist.data.preflight) would say, without building."""
    from scse_dist.cli_errors import exit_status, one_line
    from scse_dist.data.preflight import check_run_data
    from scse_dist.data.quickstart import needs_build

    try:
        check_run_data(cfg, config_path, overrides)
        building = needs_build(cfg.data)
    except Exception as err:
        if exit_status(err) is None:
            raise
        return f"the run would stop: {one_line(err)} (exit status {exit_status(err)})"
    return f"not built yet; data.build={cfg.data.build} builds it at the start" if building \
        else "present and readable"
