"""A GPU study's training cost as `scse-train --plan` sizes it (spec `costing:`), printed by
`scse-study --dry-run`: GPU-hours per stage at each assumed MFU and world size.

    costing: {gpus: [8, 64], mfu: [0.40, 0.25]}   # default: the resources' world, 40% and 25%

GPU-hours at a given MFU do not depend on the world size (the same FLOPs at the same rate per
GPU); the longest run's wall time does. A world the configured micro-batch does not divide is
planned at the largest micro-batch that divides it (the FLOPs do not change).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from scse_dist.study.runs import expand, run_config
from scse_dist.study.spec import DEFAULT_MFU, StudySpec
from scse_dist.typed_yaml import ConfigError


def _at_world(cfg, world: int):
    """The run config as it would run on `world` GPUs (a micro-batch that divides the batch)."""
    batch = cfg.train.batch
    if not isinstance(batch.micro_batch_size, int):  # auto: the planner picks one per world
        return cfg
    try:
        batch.grad_accum_for(world, batch.micro_batch_size)
        return cfg
    except ConfigError:
        sequences = batch.global_batch_tokens // cfg.data.seq_len // world
        micro = max((m for m in range(1, batch.micro_batch_size + 1) if sequences % m == 0),
                    default=1)
        train = dataclasses.replace(cfg.train, batch=dataclasses.replace(batch,
                                                                         micro_batch_size=micro))
        return dataclasses.replace(cfg, train=train)


def gpu_hours(spec: StudySpec, chosen: Optional[dict[str, float]]) -> list[str]:
    """One line per (world, MFU): planned GPU-hours per stage and the longest run; [] for a study
    without GPUs. `chosen`: the rates chosen so far. Planned once per variant and stage: seeds
    differ only in depth draws."""
    from scse_dist.train.plan import Assumptions, build

    res = spec.resources
    if not res.gpus_per_node:
        return []
    worlds = spec.costing.get("gpus") or [res.nodes * res.gpus_per_node]
    lines = []
    runs = expand(spec, chosen)
    for world in worlds:
        for mfu in spec.costing.get("mfu", DEFAULT_MFU):
            assumed = Assumptions(gpus_per_node=res.gpus_per_node, mfu=mfu)
            hours: dict[str, float] = {}
            longest, plan = 0.0, {}
            planned: dict[tuple[str, str], dict] = {}
            for run in runs:
                key = (run.variant, run.stage)
                if key not in planned:
                    planned[key] = build(_at_world(run_config(spec, run), world), world, assumed)
                plan = planned[key]
                hours[run.stage] = hours.get(run.stage, 0.0) + plan["seconds_run"] * world / 3600
                longest = max(longest, plan["seconds_run"])
            stages = ", ".join(f"{stage} {h:,.1f}" for stage, h in hours.items())
            nodes = -(-world // res.gpus_per_node)
            limit = f" (resources.time_min {res.time_min / 60:g} h)" if res.time_min else ""
            lines.append(
                f"planned GPU-hours: {sum(hours.values()):,.1f} ({stages}) on {world} x "
                f"{plan['gpu_name']} ({nodes} node(s) of {res.gpus_per_node}); the longest run "
                f"{longest / 3600:.1f} h{limit}; training only, at {mfu:.0%} MFU of "
                f"{plan['assumptions']['peak_tflops']:g} TFLOPS")
    return lines

