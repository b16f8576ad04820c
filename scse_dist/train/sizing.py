"""A run's size from its config alone: parameters, depths, and memory per rank, for
`scse-train --dry-run`, `scse-train --plan` and `micro_batch_size: auto`. In bytes:

Training state (`state_memory`): what DeepSpeed holds for AdamW per parameter, N ranks, ZeRO
stage k sharding its first k kinds (1: optimizer state, 2: + gradients, 3: + weights):

    bf16 (GPU)  weights 2 | gradients 2 (16-bit) + 4 (fp32 copy DeepSpeed's optimizer steps on)
                | optimizer 4 (fp32 master weights) + 8 (Adam's two moments)
    fp32 (CPU)  weights 4 | gradients 4 | optimizer 8 (moments), + 4 (fp32 master copy of the
                partition, which DeepSpeed's ZeRO optimizer clones even in fp32) at stage >= 1

At ZeRO-2 bf16 this is DeepSpeed's estimate (2P + 18P/N). At ZeRO-3 the weights add the gathered
working set: the loop is one leaf, gathered whole, and with the shipped zero3.json every
parameter stays gathered from forward to backward: min(P, stage3_max_live_parameters) live.

Activations (`activation_memory`): what autograd keeps for backward in one micro-batch, counted
from the model's code (blocks.py, loss.py; checked in tests/test_sizing.py). Per token, one block
(width d, hidden f; queries q = n_heads x head_dim wide, keys and values kv = n_kv_heads x
head_dim, both d by default) saves at the model's width 6 d-wide tensors (the block's input and
those of its RMSNorms and matmuls), the q/k/v projection (q + 2 kv), rotated q (q) and k (kv),
SDPA's output and its reshaped copy (q each) and the SwiGLU's four f-wide ones, plus SDPA's fp32
log-sum-exp per query head (flash attention, grouped-query too: no S x S scores); in bf16 each
RMSNorm keeps its input's fp32 copy. Blocks run: n_prelude + n_core x core_calls(T) + n_coda.
Loop checkpointing keeps only each loop step's input and recomputes one step's blocks in
backward, after the coda and the loss are freed; block checkpointing keeps each block's input.
Besides the blocks: token ids, the anchor's input and scse's r*, the final norm,
the chunked loss's gradients of its input and of the head. On top, the largest transient peak:
backward's working set (one SwiGLU's three f-wide gradients), a recomputed step or block, or
the chunked loss's logits at the end of forward (loss_chunks_bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from scse_dist.config_paths import missing_message
from scse_dist.data.config import DataConfig
from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import resolved_anchor_scale, transition_for
from scse_dist.train.config import TrainConfig
from scse_dist.train.engine_config import EngineConfig

GIB = 2**30
# DeepSpeed's default, and configs/deepspeed/zero3.json's
STAGE3_MAX_LIVE_DEFAULT = 1_000_000_000


def training_depths(model: ModelConfig, train: TrainConfig, steps: Optional[int] = None
                    ) -> list[int]:
    """The depth T of every step of the run (a loop's sampled ones; a fixed stack has one);
    `steps` replaces train.max_steps (a planned run of another length)."""
    from scse_dist.train.depth import sample_depth

    steps = train.max_steps if steps is None else steps
    fixed = transition_for(model).fixed_depth
    if fixed is not None:
        return [fixed] * steps
    return [sample_depth(step, train.depth, model.depth, train.seed, steps)
            for step in range(steps)]


def count_parameters(model: ModelConfig) -> int:
    import torch

    from scse_dist.model import LoopedLM

    with torch.device("meta"):  # shapes only: any size counts in milliseconds
        return LoopedLM(model).num_parameters()


# --------------------------------------------------------------------------- training state


@dataclass(frozen=True)
class StateMemory:
    """Bytes of one rank's training state, by kind."""
    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def stage3_max_live(engine: EngineConfig) -> int:
    """stage3_max_live_parameters of train.engine.deepspeed_config (DeepSpeed's default without
    one); FileNotFoundError naming the field if it names no local file."""
    path = engine.deepspeed_config
    if not path:
        return STAGE3_MAX_LIVE_DEFAULT
    missing = missing_message("train.engine.deepspeed_config", path) \
        if path.strip() and "://" not in path else None  # config_paths checks local paths only
    if missing:
        raise FileNotFoundError(missing)
    zero = json.loads(Path(path).read_text()).get("zero_optimization", {})
    return int(zero.get("stage3_max_live_parameters", STAGE3_MAX_LIVE_DEFAULT))


def state_memory(n_params: int, precision: str, zero_stage: int, world_size: int,
                 max_live: int = STAGE3_MAX_LIVE_DEFAULT) -> StateMemory:
    """Weights, gradients and optimizer state of one rank (the module docstring's table)."""
    p, n = n_params, world_size

    def shard(nbytes: float, from_stage: int) -> float:
        return nbytes / n if zero_stage >= from_stage else nbytes

    if precision == "bf16":
        weights = shard(2 * p, 3)
        gradients = shard(2 * p, 2) + shard(4 * p, 1)
        optimizer = shard(12 * p, 1)
        width = 2
    else:
        weights = shard(4 * p, 3)
        gradients = shard(4 * p, 2)
        optimizer = shard(8 * p, 1) + (4 * p / n if zero_stage >= 1 else 0)
        width = 4
    if zero_stage == 3 and n > 1:
        weights += width * min(p, max_live)  # gathered for forward and kept to backward
    return StateMemory(weights, gradients, optimizer)


def deepspeed_estimate(n_params: int, zero_stage: int, world_size: int, gpus_per_node: int,
                       largest_layer: int) -> tuple[Optional[int], str]:
    """DeepSpeed's own estimate of a GPU's model-state bytes (no offload), and its name; None
    for ZeRO-0/1, which DeepSpeed has no estimator for. It assumes 16-bit weights and fp32 Adam."""
    from scse_dist.quiet import name_cpu_accelerator

    nodes = max(1, -(-world_size // gpus_per_node))
    per_node = min(world_size, gpus_per_node)
    if zero_stage == 2:
        name_cpu_accelerator()
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(n_params, per_node, nodes, cpu_offload=False)
        return gpu, "estimate_zero2_model_states_mem_needs (no offload): 2P + 18P/N"
    if zero_stage == 3:
        name_cpu_accelerator()
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(n_params, largest_layer, per_node, nodes,
                                                          cpu_offload=False)
        return gpu, "estimate_zero3_model_states_mem_needs (no offload): 4 x largest layer + 18P/N"
    return None, f"DeepSpeed has no estimator for ZeRO-{zero_stage}"


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of one micro-batch's activations at the backward peak."""
    saved: float  # kept from forward to backward
    transient: float  # what backward adds at its peak (a recomputed step or block, gradients)

    @property
    def total(self) -> float:
        return self.saved + self.transient


def block_activation_bytes(m: ModelConfig, precision: str, tokens: int) -> float:
    """What one block saves for backward over `tokens` tokens (module docstring)."""
    d, f = m.d_model, m.resolved_ffn_hidden
    q, kv = m.n_heads * m.resolved_head_dim, m.resolved_n_kv_heads * m.resolved_head_dim
    width = 2 if precision == "bf16" else 4
    fp32_norm_copies = 2 * d * (4 - width)  # bf16: each RMSNorm keeps its fp32 input
    return tokens * ((6 * d + 4 * q + 3 * kv + 4 * f) * width + fp32_norm_copies
                     + 4 * m.n_heads)


def activation_memory(m: ModelConfig, data: DataConfig, train: TrainConfig, depth: int,
                      precision: str, micro_batch: int, checkpointing: Optional[str] = None,
                      cuda_memory: Optional[int] = None) -> ActivationMemory:
    """One micro-batch's activations at loop depth `depth`; `checkpointing` (none, loop, block)
    replaces model.activation_checkpointing; `cuda_memory`: the bytes of the CUDA device the
    loss's chunks are sized for (None: off CUDA)."""
    mode = m.activation_checkpointing if checkpointing is None else checkpointing
    tokens = micro_batch * data.seq_len
    width = 2 if precision == "bf16" else 4
    block = block_activation_bytes(m, precision, tokens)
    transition = transition_for(m)
    calls = transition.core_calls(depth)
    steps = depth  # loop steps, each one checkpoint under loop checkpointing
    backprop = train.depth.backprop_steps
    if backprop:
        calls, steps = min(calls, backprop + (calls - steps)), min(steps, backprop)
    outside = (m.n_prelude + m.n_coda) * block + (calls - steps) * m.n_core * block
    in_loop = steps * m.n_core * block
    # backward's own working set: the gradients of one SwiGLU's three f-wide tensors
    work = 3 * tokens * m.resolved_ffn_hidden * width
    norm = tokens * m.d_model * (4 + width)  # the final norm's fp32 input and its output
    loss = tokens * m.d_model * width + m.vocab_size * m.d_model * width  # d hidden, d head
    if mode == "loop":
        # a step's blocks recomputed, once the coda and the loss behind the loop are freed
        in_loop = steps * tokens * m.d_model * width
        transient = max(work, m.n_core * block - (m.n_coda * block + norm + loss))
    elif mode == "block":  # each block's input kept; the last coda block recomputed first
        blocks = m.n_prelude + m.n_core * calls + m.n_coda
        outside, in_loop, transient = blocks * tokens * m.d_model * width, 0, max(work, block)
    else:
        transient = work
    # the learned anchor's input s; the extra core call's output (scse's ref = r*, alive all
    # along); core_norm's anchor norm
    anchor = tokens * m.d_model * width * (transition.learned_anchor + transition.extra_core_calls)
    if resolved_anchor_scale(m) == "core_norm":
        anchor += norm
    if transition.resolved_inject == "concat":  # the adapter's input [h, s] per core call
        outside += calls * tokens * 2 * m.d_model * width
    saved = outside + in_loop + 8 * tokens + norm + anchor + loss
    return ActivationMemory(saved, max(transient,
                                       loss_chunks_bytes(m.vocab_size, tokens, cuda_memory)))


def checkpointing_for(m: ModelConfig, data: DataConfig, train: TrainConfig, world_size: int,
                      precision: str, budget: float, cuda_memory: Optional[int] = None
                      ) -> Literal["none", "loop", "block", "auto"]:
    """model.activation_checkpointing resolved: auto is none where the largest micro-batch the
    run may use, at the deepest T it draws, fits beside the training state in `budget` bytes
    without checkpointing, else loop (whose recompute, about a fifth of a step, buys the memory);
    any other value as it is."""
    if m.activation_checkpointing != "auto":
        return m.activation_checkpointing
    micro = train.batch.micro_batch_at(world_size)
    states = state_memory(count_parameters(m), precision, train.engine.zero_stage, world_size,
                          stage3_max_live(train.engine)).total
    depth = max(training_depths(m, train), default=m.depth)
    need = states + activation_memory(m, data, train, depth, precision, micro, "none",
                                      cuda_memory).total
    return "none" if need <= budget else "loop"


def loss_chunks_bytes(vocab: int, tokens: int, cuda_memory: Optional[int] = None) -> float:
    """The chunked loss's peak at the end of forward, beside every saved activation: a chunk's fp32
    logits, logsumexp's temporary of the same size and, from the second chunk on, the previous
    chunk's gradient still held while the next chunk's logits are formed. Chunks as
    scse_dist.model.loss sizes them (`cuda_memory`: on a CUDA device of that many bytes)."""
    from scse_dist.model.loss import chunk_rows  # imports torch: not before a plan's checks

    rows = min(tokens, chunk_rows(vocab, cuda_memory))
    return rows * vocab * 4 * (3 if tokens > rows else 2)
