"""`scse-train --plan`: whether a config fits W GPUs of one kind and how long it takes, before it
queues (docs/launching.md, "Sizing a run"). Nothing runs: the model is built on torch's meta
device. Every assumption is printed with the flag that changes it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

from scse_dist.config import RunConfig
from scse_dist.data.config import DataConfig
from scse_dist.model.config import ModelConfig
from scse_dist.train.config import TrainConfig
from scse_dist.train.sizing import (
    GIB,
    activation_memory,
    checkpointing_for,
    count_parameters,
    deepspeed_estimate,
    stage3_max_live,
    state_memory,
    training_depths,
)
from scse_dist.typed_yaml import ConfigError


@dataclass(frozen=True)
class Gpu:
    name: str  # a substring of torch.cuda.get_device_name(): the key of metrics' peak table
    memory_mib: int  # what nvidia-smi reports as total
    nvlink_gbs: float  # GB/s one GPU sends within a node (NVLink, one direction)
    network_gbs: float  # GB/s one GPU sends to other nodes (its NIC)


GPUS = {"h100": Gpu("H100", 81559, 450.0, 50.0),  # SXM 80GB, NVLink 4, 400 Gb/s NDR per GPU
        "h200": Gpu("H200", 143771, 450.0, 50.0),  # SXM 141GB, NVLink 4, 400 Gb/s NDR per GPU
        "a100": Gpu("A100", 81920, 300.0, 25.0)}  # SXM 80GB, NVLink 3, 200 Gb/s HDR per GPU


@dataclass(frozen=True)
class Assumptions:
    gpu: str = "h100"
    mfu: float = 0.40
    gpus_per_node: int = 8
    link_gbs: Optional[float] = None  # None: the GPU's NVLink on one node, its NIC across nodes
    memory_fraction: float = 0.90  # of the GPU's memory the plan may fill
    tokens: Optional[float] = None  # None: train.max_steps steps


def peak_flops(gpu: Gpu) -> float:
    from scse_dist.train.metrics import CUDA_PEAK_BF16

    return next(flops for key, flops in CUDA_PEAK_BF16 if key in gpu.name)


def check(world_size: int, a: Assumptions) -> Gpu:
    """The GPU, or a ConfigError naming the flag."""
    if a.gpu not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU {a.gpu!r}; one of {', '.join(sorted(GPUS))}")
    for flag, value, low in (("--world-size", world_size, 1),
                             ("--gpus-per-node", a.gpus_per_node, 1)):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    if not 0 < a.mfu <= 1:
        raise ConfigError(f"--mfu: a fraction in (0, 1], got {a.mfu}")
    if not 0 < a.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction: a fraction in (0, 1], got {a.memory_fraction}")
    if a.link_gbs is not None and a.link_gbs <= 0:
        raise ConfigError(f"--link-gbs: must be > 0, got {a.link_gbs}")
    if a.tokens is not None and a.tokens <= 0:
        raise ConfigError(f"--tokens: must be > 0, got {a.tokens}")
    return GPUS[a.gpu]


def largest_layer(model: ModelConfig) -> int:
    """Parameters of the module holding the most of its own (DeepSpeed's ZeRO-3 estimator's)."""
    import torch

    from scse_dist.model import LoopedLM

    with torch.device("meta"):
        net = LoopedLM(model)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules())


def comm_bytes(n_params: int, width: int, zero_stage: int, world_size: int, accum: int) -> float:
    """Bytes one GPU sends per optimizer step in ring collectives ((W-1)/W of the tensor each),
    in passes over the weights (docs/launching.md, "Sizing a run")."""
    share = n_params * width * (world_size - 1) / world_size
    passes = {0: 2, 1: 2, 2: accum + 1, 3: 3 * accum}[zero_stage]
    return passes * share


def micro_batch_fits(model: ModelConfig, data: DataConfig, train: TrainConfig, depth: int,
                     precision: str, budget: float, states: float, mode: str,
                     cuda_memory: Optional[int] = None) -> int:
    """The largest micro-batch whose activations fit beside the training state (0: none)."""
    def activations(size: int) -> float:
        return activation_memory(model, data, train, depth, precision, size, mode,
                                 cuda_memory).total

    def fits(size: int) -> bool:
        return states + activations(size) <= budget

    # activations grow about linearly in the micro-batch: start from that line, then step
    fixed = activations(0)
    per_sequence = activations(1) - fixed
    size = max(0, math.floor((budget - states - fixed) / per_sequence))
    while fits(size + 1):
        size += 1
    while size and not fits(size):
        size -= 1
    return size


def build(cfg: RunConfig, world_size: int, a: Assumptions = Assumptions()) -> dict:
    """The plan as one dict of numbers and notes (what --json prints; render() is the table)."""
    from scse_dist.model import flops_per_token

    gpu = check(world_size, a)
    t, m, seq_len = cfg.train, cfg.model, cfg.data.seq_len
    if t.batch.micro_batch_size == "auto":
        candidates = t.batch.micro_batch_candidates(world_size)
    else:
        candidates = [t.batch.micro_batch_size]
    # a batch that does not divide: before torch
    t.batch.grad_accum_for(world_size, candidates[0], world_from="from --world-size")
    # every GPU here has bf16
    precision = "bf16" if t.engine.precision == "auto" else t.engine.precision
    width = 2 if precision == "bf16" else 4
    capacity = gpu.memory_mib * 2**20
    budget = a.memory_fraction * capacity
    n_params = count_parameters(m)
    max_live = stage3_max_live(t.engine)
    states = state_memory(n_params, precision, t.engine.zero_stage, world_size, max_live)
    ds_bytes, ds_name = deepspeed_estimate(n_params, t.engine.zero_stage, world_size,
                                           a.gpus_per_node, largest_layer(m))
    # DeepSpeed's estimator where it describes this config: 16-bit weights with AdamW at ZeRO-2
    # (at ZeRO-3 it counts only the largest layer gathered; the loop's leaf gathers more)
    use_ds = ds_bytes is not None and t.engine.zero_stage == 2 and precision == "bf16" \
        and t.optimizer.kind != "muon"
    state_total = float(ds_bytes) if use_ds and ds_bytes is not None else states.total
    # auto: by this budget
    mode = checkpointing_for(m, cfg.data, t, world_size, precision, budget, capacity)
    modes = sorted({mode, "none", "loop"}, key=["none", "loop", "block"].index)

    def at_steps(steps: int) -> tuple[list[int], int, dict[str, int]]:
        """The depths drawn, the deepest, and the largest micro-batch that fits, by mode."""
        depths = training_depths(m, t, steps)  # one draw per step: seconds at 20,000 steps
        deepest = max(depths, default=m.depth)
        return depths, deepest, {k: micro_batch_fits(m, cfg.data, t, deepest, precision, budget,
                                                     state_total, k, capacity) for k in modes}

    # auto's micro-batch needs the deepest T; --tokens' steps need the micro-batch: the run's
    # own steps first, redone if --tokens gives another length
    depths, deepest_t, largest = at_steps(t.max_steps)
    micro = next((c for c in candidates if c <= largest[mode]), candidates[-1]) \
        if t.batch.micro_batch_size == "auto" else t.batch.micro_batch_size
    accum = t.batch.grad_accum_for(world_size, micro)
    tokens_per_step = world_size * micro * accum * seq_len
    steps = t.max_steps if a.tokens is None else math.ceil(a.tokens / tokens_per_step)
    if steps != t.max_steps:
        depths, deepest_t, largest = at_steps(steps)
    run_flops = tokens_per_step * sum(n * flops_per_token(m, d, seq_len, t.depth.backprop_steps)
                                      for d, n in Counter(depths).items())
    step_flops = run_flops / max(1, steps)
    activations = {k: activation_memory(m, cfg.data, t, deepest_t, precision, micro, k,
                                        capacity).total for k in modes}
    peak = state_total + activations[mode]

    per_gpu_flops = peak_flops(gpu) * a.mfu
    step_s = step_flops / world_size / per_gpu_flops
    nodes = -(-world_size // a.gpus_per_node)
    link = a.link_gbs or (gpu.nvlink_gbs if nodes == 1 else gpu.network_gbs)
    sent = comm_bytes(n_params, width, t.engine.zero_stage, world_size, accum)
    comm_s = sent / (link * 1e9)
    return {
        "config": cfg.name, "gpu": a.gpu, "gpu_name": gpu.name, "world_size": world_size,
        "nodes": nodes, "precision": precision, "zero_stage": t.engine.zero_stage,
        "activation_checkpointing": mode, "parameters": n_params,
        "micro_batch": micro, "grad_accum_steps": accum, "seq_len": seq_len,
        "global_batch": t.batch.batch_derivation(seq_len, world_size, micro),
        "tokens_per_step": tokens_per_step, "steps": steps, "tokens": steps * tokens_per_step,
        "depth": {"kind": t.depth.kind, "min": min(depths, default=m.depth),
                  "mean": sum(depths) / len(depths) if depths else float(m.depth),
                  "max": deepest_t},
        "memory_bytes": {"weights": states.weights, "gradients": states.gradients,
                         "optimizer": states.optimizer, "training_state": state_total,
                         "activations": activations, "peak": peak, "capacity": capacity,
                         "budget": budget},
        "training_state_formula": "DeepSpeed " + ds_name if use_ds else
        "scse_dist.train.sizing (" + ("bf16 weights, fp32 AdamW" if precision == "bf16"
                                      else "fp32") + ")",
        "deepspeed_estimate_bytes": ds_bytes, "deepspeed_estimator": ds_name,
        "fits": peak <= budget,
        "largest_micro_batch": largest,
        "micro_batch_candidates": candidates if t.batch.micro_batch_size == "auto" else None,
        "communication": {"bytes_per_step": sent, "link_gbs": link, "seconds_per_step": comm_s},
        "flops_per_step": step_flops, "flops_run": run_flops,
        "seconds_per_step": step_s, "seconds_run": step_s * steps,
        "tokens_per_s": tokens_per_step / step_s,
        "assumptions": {**asdict(a), "link_gbs": link, "peak_tflops": peak_flops(gpu) / 1e12,
                        "gpu_memory_gib": capacity / GIB},
    }


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f} GiB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def render(p: dict) -> str:
    """The plan as an aligned table, then its assumptions."""
    mem, d, a, c = p["memory_bytes"], p["depth"], p["assumptions"], p["communication"]
    mode = p["activation_checkpointing"]
    where = f"{p['world_size']} x {p['gpu_name']}" + (
        f" ({p['nodes']} nodes of {a['gpus_per_node']})" if p["nodes"] > 1 else "")
    rows = [
        ("parameters", f"{p['parameters']:,}", ""),
        ("batch per step", p["global_batch"], ""),
        ("run", f"{p['steps']:,} steps, {p['tokens']:,} tokens",
         "--tokens" if a["tokens"] else "train.max_steps"),
        ("depth T", f"min {d['min']}, mean {d['mean']:.2f}, max {d['max']}",
         f"train.depth.kind {d['kind']}; memory at the deepest"),
        ("weights", gib(mem["weights"]), f"ZeRO-{p['zero_stage']}, {p['precision']}"),
        ("gradients", gib(mem["gradients"]), ""),
        ("optimizer state", gib(mem["optimizer"]), ""),
        ("training state", gib(mem["training_state"]), p["training_state_formula"]),
    ]
    if p["deepspeed_estimate_bytes"] is not None \
            and not p["training_state_formula"].startswith("DeepSpeed"):
        rows.append(("  DeepSpeed's estimate", gib(p["deepspeed_estimate_bytes"]),
                     p["deepspeed_estimator"] + " (not used: it assumes one layer gathered)"))
    for k, nbytes in mem["activations"].items():
        label = {"none": "no checkpointing", "loop": "loop checkpointing",
                 "block": "block checkpointing"}[k]
        rows.append((f"activations, {label}", gib(nbytes),
                     f"micro-batch {p['micro_batch']} at T={d['max']}"
                     + (" (the config's)" if k == mode else "")))
    rows += [
        ("peak per GPU", gib(mem["peak"]),
         f"{'fits' if p['fits'] else 'DOES NOT FIT'} in {gib(mem['budget'])} "
         f"({a['memory_fraction']:.0%} of {gib(mem['capacity'])})"),
        ("largest micro-batch", ", ".join(f"{k} {n}" for k, n in p["largest_micro_batch"].items()),
         "that fits, by checkpointing" + (
             f"; auto's candidates {p['micro_batch_candidates']}" if p["micro_batch_candidates"]
             else "")),
        ("communication", f"{c['bytes_per_step'] / GIB:.2f} GiB sent per GPU per step",
         f"{_duration(c['seconds_per_step'])} at {c['link_gbs']:g} GB/s"),
        ("compute per step", f"{p['flops_per_step']:.3e} FLOPs",
         f"{p['tokens_per_s']:,.0f} tokens/s"),
        ("time per step", _duration(p["seconds_per_step"]),
         f"at {a['mfu']:.1%} MFU of {a['peak_tflops']:g} TFLOPS"),
        ("time for the run", _duration(p["seconds_run"]), f"{p['flops_run']:.3e} FLOPs"),
    ]
    if c["seconds_per_step"] > p["seconds_per_step"]:
        rows.append(("warning", "communication alone takes longer than the step",
                     "the MFU assumed cannot be reached on this link"))
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"plan: {p['config']} on {where}, {p['precision']}, ZeRO-{p['zero_stage']}, "
             f"activation_checkpointing {mode}"]
    lines += [f"  {label:<{width}}  {value:<{value_width}}  {note}".rstrip()
              for label, value, note in rows]
    lines.append("assumptions:")
    lines += [f"  {line}" for line in (
        f"{a['mfu']:.1%} MFU (--mfu) of {a['peak_tflops']:g} TFLOPS dense bf16 per {p['gpu_name']}",
        f"{a['gpu_memory_gib']:.1f} GiB per GPU, {a['memory_fraction']:.0%} usable "
        "(--memory-fraction; the rest: CUDA context, NCCL, fragmentation)",
        f"{a['gpus_per_node']} GPUs per node (--gpus-per-node), ring collectives at "
        f"{a['link_gbs']:g} GB/s per GPU (--link-gbs), not overlapped with compute",
        "FLOPs: scse_dist.model.flops at each step's sampled T; memory: scse_dist.train.sizing",
    )]
    return "\n".join(lines)
