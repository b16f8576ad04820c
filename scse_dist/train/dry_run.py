"""`scse-train --dry-run`: what a config would do, from the config alone, without doing any of it:
parameters (on torch's meta device), the global batch's split, the depths and FLOPs, the tokens,
the memory per rank (scse_dist.train.sizing). Creates nothing; the CLI then runs the run's own
checks, so it exits with the status the run would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from scse_dist.config import RunConfig
from scse_dist.train.sizing import (
    GIB,
    activation_memory,
    count_parameters,
    state_memory,
    training_depths,
)
from scse_dist.typed_yaml import ConfigError


def describe(cfg: RunConfig, world_size: Optional[int] = None) -> str:
    """The dry run's report, one fact per line, at `world_size` (None: the launcher's). The data
    line comes after the run's own checks (scse_dist.train.cli.check_can_start)."""
    from scse_dist.distributed import launcher_world
    from scse_dist.model import flops_per_token
    from scse_dist.train.engine import resolve_precision

    if world_size is None:
        world_size, world_from = launcher_world(os.environ)
    else:
        world_from = "from --world-size"
        if world_size < 1:
            raise ConfigError(f"--world-size: must be >= 1, got {world_size}")

    t, seq_len = cfg.train, cfg.data.seq_len
    accum = t.batch.grad_accum_for(world_size, world_from=world_from)
    micro = t.batch.micro_batch_at(world_size)  # auto: the most it may take
    tokens_per_step = world_size * micro * accum * seq_len
    depths = training_depths(cfg.model, t)
    backprop = t.depth.backprop_steps
    flops = [flops_per_token(cfg.model, d, seq_len, backprop) for d in depths]
    n_params = count_parameters(cfg.model)
    precision = resolve_precision(t.engine.precision)
    states = state_memory(n_params, precision, t.engine.zero_stage, world_size).total
    activations = activation_memory(cfg.model, cfg.data, t, max(depths, default=cfg.model.depth),
                                    precision, micro).total
    mean = sum(flops) / len(flops) if flops else 0.0
    lines = [
        f"dry run of {cfg.name}: nothing is created (run dir {Path(cfg.output_dir) / cfg.name})",
        f"parameters: {n_params:,}",
        t.batch.batch_derivation(seq_len, world_size, world_from=world_from)
        + (f" (micro-batch auto: at most {micro}; the probe at start-up may take less and "
           "accumulate more)" if t.batch.micro_batch_size == "auto" else ""),
        f"steps: {t.max_steps:,}, tokens the run will see: {t.max_steps * tokens_per_step:,}",
        f"training depth T ({t.depth.kind}): min {min(depths, default=0)}, mean "
        f"{sum(depths) / max(1, len(depths)):.2f}, max {max(depths, default=0)}",
        f"training FLOPs per token (forward + backward): {mean:.3e} at the mean over steps, "
        + ", ".join(f"{flops_per_token(cfg.model, d, seq_len, backprop):.3e} at T={d}"
                    for d in sorted({min(depths), max(depths)}) if depths),
        f"training FLOPs in all: {sum(flops) * tokens_per_step:.3e}",
        f"memory per rank: {(states + activations) / GIB:.2f} GiB = weights, gradients "
        f"and optimizer state {states / GIB:.2f} GiB ({precision}, ZeRO-{t.engine.zero_stage}) + "
        f"activations of one micro-batch at T={max(depths, default=0)} {activations / GIB:.2f} GiB",
    ]
    return "\n".join(lines)
