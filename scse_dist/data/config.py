"""The `data:` section of a run config: where the token shards are and how they are read.

Beside the package it configures, and below it: a leaf that imports nothing, so `scse_dist.config`
composes it without loading the data stack (or torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class DataConfig:
    # fsspec URL or path of a shard directory holding index.json (see scse_dist.data.shards).
    path: str = "data/quickstart/shards"
    # sentencepiece model the shards were written with.
    tokenizer: str = "data/quickstart/tokenizer.model"
    # If set and `path` has no index.json, build it first. "stdlib_docs": the quickstart corpus.
    build: Optional[Literal["stdlib_docs"]] = None
    build_vocab_size: int = 4096
    heldout_fraction: float = 0.02
    seq_len: int = 256
    # DataLoader worker processes per rank (0: read in the training process). Each (rank, worker)
    # is one reader; resuming needs the same world size and num_workers.
    num_workers: int = 0
    # Samples in the seeded shuffle buffer mixing each reader's samples across shards (0: off).
    shuffle_buffer: int = 0
    # Corrupt shards/samples skipped with a warning before the run stops.
    max_failures: int = 100
    # Train on a weighted mixture of these shard directories instead of `path` (held-out
    # evaluation still reads `path`); weights are relative, one per path.
    mixture_paths: list[str] = field(default_factory=list)
    mixture_weights: list[float] = field(default_factory=list)
