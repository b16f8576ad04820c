"""train.batch: how many sequences a step trains on, and how they split into micro-batches per
rank (scse_dist.train.micro_batch chooses micro_batch_size: auto). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from scse_dist.typed_yaml import ConfigError


@dataclass
class BatchConfig:
    # auto: the largest power of two dividing the rank's share of the global batch that fits
    micro_batch_size: Union[int, Literal["auto"]] = field(default=8, metadata={"gt": 0})
    grad_accum_steps: int = field(default=1, metadata={"gt": 0})
    # Sequences per optimizer step over all ranks (0: micro x accum x world); when set,
    # grad_accum_steps is derived from it, so the batch stays the same at any world size.
    global_batch_size: int = field(default=0, metadata={"ge": 0})
    # the same in tokens (scse_dist.config sets both)
    global_batch_tokens: int = field(default=0, metadata={"ge": 0})
    # auto on CPU: the GiB a probe may take (0: half of MemAvailable, shared by the node's ranks)
    micro_batch_memory_gib: float = field(default=0.0, metadata={"ge": 0})

    def check(self) -> None:
        """Combinations no run can train with (one ConfigError naming the field)."""
        if self.micro_batch_size != "auto":
            return
        if not (self.global_batch_size or self.global_batch_tokens):  # the batch auto keeps
            raise ConfigError("train.batch.micro_batch_size: auto needs "
                              "train.batch.global_batch_size or train.batch.global_batch_tokens "
                              "(the batch per optimizer step it keeps while choosing the "
                              "micro-batch); set one, e.g. train.batch.global_batch_size=64")
        if self.grad_accum_steps != 1:
            raise ConfigError(f"train.batch.grad_accum_steps: {self.grad_accum_steps} with "
                              "train.batch.micro_batch_size: auto, which derives it; leave it at 1")

    def check_tokens(self, seq_len: int) -> None:
        """global_batch_tokens: whole sequences of data.seq_len, and the same batch as
        global_batch_size where both are set (a run's config.yaml holds both)."""
        if not self.global_batch_tokens:
            return
        if self.global_batch_tokens % seq_len:
            raise ConfigError(f"train.batch.global_batch_tokens: {self.global_batch_tokens} is not "
                              f"a multiple of data.seq_len ({seq_len}), so it is no whole number "
                              "of sequences")
        sequences = self.global_batch_tokens // seq_len
        if self.global_batch_size and self.global_batch_size != sequences:
            raise ConfigError(f"train.batch.global_batch_size: {self.global_batch_size} "
                              f"contradicts train.batch.global_batch_tokens="
                              f"{self.global_batch_tokens} ({sequences} sequences of data.seq_len "
                              f"{seq_len}); give one of them, the other 0")

    def global_batch_name(self) -> str:
        """The field the global batch was given in, for error messages:
        'train.batch.global_batch_size: 512' or 'train.batch.global_batch_tokens: 524288 (512
        sequences of data.seq_len 1024)'."""
        if self.global_batch_tokens and self.global_batch_size:
            return (f"train.batch.global_batch_tokens: {self.global_batch_tokens} "
                    f"({self.global_batch_size} sequences of data.seq_len "
                    f"{self.global_batch_tokens // self.global_batch_size})")
        return f"train.batch.global_batch_size: {self.global_batch_size}"

    def micro_batch_candidates(self, world_size: int, world_from: str = "") -> list[int]:
        """micro_batch_size: auto's candidates at `world_size`: the powers of two that divide the
        global batch's share of one rank, largest first (ConfigError if there is no such share).
        `world_from` says where the world size came from, for the error."""
        if self.global_batch_size % world_size:
            raise ConfigError(f"{self.global_batch_name()} is not a multiple of the world size "
                              f"({_world(world_size, world_from)}), so "
                              "train.batch.micro_batch_size: auto has no per-rank share to split")
        per_rank = self.global_batch_size // world_size
        return [1 << k for k in range(per_rank.bit_length() - 1, -1, -1)
                if per_rank % (1 << k) == 0]

    def micro_batch_at(self, world_size: int, micro_batch_size: Optional[int] = None,
                       world_from: str = "") -> int:
        """`micro_batch_size` (the one chosen) when given, else the configured one; auto counts at
        its largest candidate."""
        micro = micro_batch_size or self.micro_batch_size
        return self.micro_batch_candidates(world_size, world_from)[0] if micro == "auto" else micro

    def grad_accum_for(self, world_size: int, micro_batch_size: Optional[int] = None,
                       world_from: str = "") -> int:
        """Micro-batches per optimizer step at `world_size` ranks (ConfigError if it cannot fit),
        at micro_batch_at's micro-batch. `world_from` says where the world size came from ("from
        WORLD_SIZE", "from --world-size"), for the error."""
        if not self.global_batch_size:
            return self.grad_accum_steps
        micro = self.micro_batch_at(world_size, micro_batch_size, world_from)
        per_pass = micro * world_size
        if self.global_batch_size % per_pass:
            raise ConfigError(
                f"{self.global_batch_name()} is not a multiple of train.batch.micro_batch_size "
                f"({micro}) x world size ({_world(world_size, world_from)})")
        accum = self.global_batch_size // per_pass
        if self.grad_accum_steps not in (1, accum):
            raise ConfigError(
                f"train.batch.grad_accum_steps: {self.grad_accum_steps} contradicts "
                f"{self.global_batch_name().replace(': ', '=', 1)}, which needs {accum} at world "
                f"size {world_size}; leave grad_accum_steps at 1 or set the global batch to 0")
        return accum

    def batch_derivation(self, seq_len: int, world_size: int,
                         micro_batch_size: Optional[int] = None, world_from: str = "") -> str:
        """'global batch 512 seq (524288 tokens) = micro 8 x accum 8 x world 8' (auto: at its
        largest candidate unless `micro_batch_size` is given); ConfigError where it cannot fit."""
        accum = self.grad_accum_for(world_size, micro_batch_size, world_from)
        micro = self.micro_batch_at(world_size, micro_batch_size, world_from)
        sequences = micro * accum * world_size
        line = (f"global batch {sequences} seq ({sequences * seq_len} tokens) = micro {micro} x "
                f"accum {accum} x world {world_size}")
        if not self.global_batch_size:
            line += " (train.batch.global_batch_size unset: the batch grows with the world size)"
        return line


def _world(world_size: int, world_from: str) -> str:
    return f"{world_size}, {world_from}" if world_from else str(world_size)
