"""The `data:` section of a run config: where the token shards are and how they are read.

Beside the package it configures, and below it: it imports only the model's ConfigError, so
`scse_dist.config` composes it without loading the data stack (or torch). `check()` is the
section's one validation; scse_dist.config runs it, then the checks across sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from scse_dist.model.config import ConfigError

TokenizerKind = Literal["sentencepiece", "hf", "tiktoken"]
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = ("sentencepiece", "hf", "tiktoken")
# The file an export carries for each kind (scse_dist.checkpoint.export); tiktoken's settings
# (pattern, special tokens) go beside its ranks as NAME.json. Here, not in data.tokenizer, so that
# reading an export's config loads no tokenizer library.
TOKENIZER_EXPORT_NAMES = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json",
                          "tiktoken": "tokenizer.tiktoken"}


@dataclass
class DataConfig:
    # fsspec URL or path of a shard directory holding index.json (see scse_dist.data.shards).
    path: str = "data/quickstart/shards"
    # The tokenizer file the shards were written with: a sentencepiece .model, a Hugging Face
    # tokenizer.json or a tiktoken ranks file (docs/data.md, "Tokenizers").
    tokenizer: str = "data/quickstart/tokenizer.model"
    # Which of those it is; "auto" tells them apart by content (JSON, `base64 rank` lines, else
    # sentencepiece). An export writes the kind it carries here.
    tokenizer_kind: Literal["auto", "sentencepiece", "hf", "tiktoken"] = "auto"
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
    # Corrupt shards/samples skipped (one line each on stderr) before the run stops (exit 65).
    max_failures: int = 100
    # Train on a weighted mixture of these shard directories instead of `path` (held-out
    # evaluation still reads `path`); weights are relative, one per path.
    mixture_paths: list[str] = field(default_factory=list)
    mixture_weights: list[float] = field(default_factory=list)

    def check(self) -> None:
        """Values no data stream can use (one ConfigError naming the field)."""
        if self.seq_len <= 0:
            raise ConfigError(f"data.seq_len: must be > 0, got {self.seq_len}")
        if len(self.mixture_weights) != len(self.mixture_paths) or \
                any(w <= 0 for w in self.mixture_weights):
            raise ConfigError(f"data.mixture_weights: need one positive weight per "
                              f"data.mixture_paths entry, got {self.mixture_weights} for "
                              f"{len(self.mixture_paths)} paths")
        for name in ("num_workers", "shuffle_buffer", "max_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"data.heldout_fraction: must lie in [0, 1), got "
                              f"{self.heldout_fraction}")
