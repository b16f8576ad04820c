"""`train.batch.micro_batch_size: auto`: the largest micro-batch that fits, found by probing.

The candidates (BatchConfig.micro_batch_candidates) are tried largest first; every rank takes the
smallest of the ranks' choices. A probe is one forward + backward of random tokens at the deepest
T the run draws; it leaves no gradients and restores every RNG stream, so training after it is
bit for bit that of a fixed micro-batch of the same size. "Fits": on CUDA, no OutOfMemoryError;
on CPU (where the kernel kills instead) the probe's peak RSS growth plus the optimizer state it
does not allocate stays under the budget (train.batch.micro_batch_memory_gib).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from scse_dist.data.config import DataConfig
from scse_dist.train.config import TrainConfig
from scse_dist.train.engine import resolve_precision
from scse_dist.train.engine_config import EngineConfig
from scse_dist.train.sizing import GIB, state_memory, training_depths
from scse_dist.typed_yaml import ConfigError

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

# Why a candidate does not fit, or None when it does.
WhyNot = Callable[[int], Optional[str]]


class Choice(NamedTuple):
    size: int  # 0: not even the smallest candidate fits
    refused: Optional[tuple[int, str]]  # the candidate just above `size` and why it does not fit


def choose(candidates: Sequence[int], why_not: WhyNot) -> Choice:
    """The first of `candidates` (largest first) that fits; stops probing there."""
    refused = None
    for size in candidates:
        reason = why_not(size)
        if reason is None:
            return Choice(size, refused)
        refused = (size, reason)
    return Choice(0, refused)


# --------------------------------------------------------------------------- the probe


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every RNG stream the trainer draws from, as it was before."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def probe(model: LoopedLM, size: int, data: DataConfig, train: TrainConfig,
          depth: Optional[int], device: torch.device) -> None:
    """One forward + backward of `size` random sequences of data.seq_len tokens from the model's
    vocabulary; no step, the gradients dropped after."""
    tokens = torch.randint(0, model.cfg.vocab_size, (size, data.seq_len + 1),
                           generator=torch.Generator().manual_seed(size)).to(device)
    # bf16 runs probe under autocast over fp32 weights (an upper bound), on CPU as on CUDA
    bf16 = resolve_precision(train.engine.precision) == "bf16"
    try:
        with preserved_rng(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            out = model(tokens[:, :-1], tokens[:, 1:], depth=depth,
                        backprop_steps=train.depth.backprop_steps, keep_logits=False)
            out.loss.backward()
            del out
    finally:
        for param in model.parameters():
            param.grad = None


def optimizer_reserve(engine: EngineConfig, model: torch.nn.Module, world_size: int) -> int:
    """Bytes of training state a probe does not hold (it holds fp32 weights and gradients): the
    optimizer's moments and master weights, as DeepSpeed will shard them."""
    n = sum(p.numel() for p in model.parameters())
    held = n * (4 + 4)
    states = state_memory(n, resolve_precision(engine.precision), engine.zero_stage, world_size)
    return max(0, int(states.total) - held)


# --------------------------------------------------------------------------- "fits" on CUDA


def cuda_why_not(run: Callable[[int], None], reserve: int, device: torch.device) -> WhyNot:
    def why_not(size: int) -> Optional[str]:
        held = None
        try:
            held = torch.empty(reserve, dtype=torch.uint8, device=device)  # the optimizer's share
            run(size)
            return None
        except torch.cuda.OutOfMemoryError:
            return "ran out of memory"
        finally:
            del held
            gc.collect()
            torch.cuda.empty_cache()  # the next, smaller probe starts from an empty cache
    return why_not


# --------------------------------------------------------------------------- "fits" on CPU


def _status_kib(key: str, path: str = "/proc/self/status") -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path(path).read_text(), re.M)
    return int(match.group(1)) if match else 0


def _release_freed_memory() -> None:
    """Freed tensors back to the kernel, so the next probe's baseline is what is really held."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_growth(run: Callable[[], None]) -> int:
    """Bytes the process's peak RSS rose above its RSS while `run` ran."""
    _release_freed_memory()
    base = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the RSS now
    except OSError as exc:
        raise ConfigError("train.batch.micro_batch_size: auto on CPU measures peak memory through "
                          f"/proc/self/clear_refs, which cannot be written here ({exc.strerror}); "
                          "set train.batch.micro_batch_size to a number") from None
    run()
    return (_status_kib("VmHWM") - base) * 1024


def default_budget(local_world_size: int) -> int:
    """Half of MemAvailable, split between the node's ranks: the other half stays for data loader
    workers, the page cache the shards are read through, and the allocator's slack."""
    available_kib = _status_kib("MemAvailable", "/proc/meminfo")
    if not available_kib:
        raise ConfigError("train.batch.micro_batch_memory_gib: /proc/meminfo has no MemAvailable "
                          "to default from; set train.batch.micro_batch_memory_gib")
    return available_kib * 1024 // 2 // max(1, local_world_size)


class CpuBudget:
    """why_not on CPU: measured need (peak RSS growth + optimizer reserve) against the budget.

    The two smallest candidates are measured first: a candidate whose straight-line estimate
    through them is over twice the budget is refused without running (no OOM signal on CPU: the
    kernel would kill the process instead)."""

    def __init__(self, run: Callable[[int], None], budget: int, reserve: int):
        self.run, self.budget, self.reserve = run, budget, reserve
        self.measured: dict[int, int] = {}

    def need(self, size: int) -> int:
        if size not in self.measured:
            self.measured[size] = peak_rss_growth(lambda: self.run(size)) + self.reserve
        return self.measured[size]

    def why_not(self, size: int) -> Optional[str]:
        if size > 2:
            per_sequence = self.need(2) - self.need(1)
            estimate = self.need(1) + per_sequence * (size - 1)
            if estimate > 2 * self.budget:
                return f"would need about {gib(estimate)} of the {gib(self.budget)} budget"
        need = self.need(size)
        return None if need <= self.budget else \
            f"needs {gib(need)} of the {gib(self.budget)} budget"


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.3g} GiB"


# --------------------------------------------------------------------------- the choice


def agree(size: int, device: torch.device) -> int:
    """The smallest of the ranks' choices: every rank then runs the same micro-batch."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return size
    value = torch.tensor([size], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())


def find_micro_batch(train: TrainConfig, data: DataConfig, model: LoopedLM, world_size: int,
                     local_world_size: int, device: torch.device) -> tuple[int, str]:
    """(the micro-batch every rank agreed on, the line that says what was chosen and why)."""
    candidates = train.batch.micro_batch_candidates(world_size)
    # the deepest T the run draws (None for an untied model: its one depth)
    depth = None if model.fixed_depth is not None else max(training_depths(model.cfg, train))
    model.to(device)  # DeepSpeed would move it there anyway; values unchanged

    def run(size: int) -> None:
        probe(model, size, data, train, depth, device)

    reserve = optimizer_reserve(train.engine, model, world_size)
    if device.type == "cuda":
        why_not = cuda_why_not(run, reserve, device)
        budget = None
    else:
        budget = int(train.batch.micro_batch_memory_gib * GIB) or default_budget(local_world_size)
        run(candidates[-1])  # first-call allocations (autograd, thread pools) out of the measures
        why_not = CpuBudget(run, budget, reserve).why_not
    local = choose(candidates, why_not)
    size = agree(local.size, device)
    where = f"at T={depth or model.fixed_depth}" + (
        f" under a CPU budget of {gib(budget)}" if budget is not None else "")
    if size == 0:
        raise ConfigError(
            f"train.batch.micro_batch_size: auto: not even 1 sequence per micro-batch fits {where} "
            f"({local.refused[1] if local.refused else 'on another rank'}); shorten data.seq_len, "
            "turn on model.activation_checkpointing or raise train.batch.micro_batch_memory_gib")
    accum = train.batch.grad_accum_for(world_size, size)
    return size, (f"micro-batch auto: {size} ({_reason(local, size, candidates)}) {where}; "
                  f"grad_accum_steps {accum} for global batch {train.batch.global_batch_size} "
                  f"at world size {world_size}")


def _reason(local: Choice, size: int, candidates: Sequence[int]) -> str:
    if size != local.size:
        return f"the smallest rank's choice; this rank fits {local.size}"
    if local.refused is None:
        return f"the largest candidate, {candidates[0]}, fits"
    return f"{local.refused[0]} {local.refused[1]}"
