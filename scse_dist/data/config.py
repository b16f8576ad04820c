"""The `data:` section of a run config (docs/config.md): where the token shards are and how they
are read. It imports only typed_yaml's ConfigError, so the config loads without the data stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError

TokenizerKind = Literal["sentencepiece", "hf", "tiktoken"]
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = ("sentencepiece", "hf", "tiktoken")
# The file an export carries for each kind (tiktoken's settings beside it as NAME.json); here so
# that reading an export's config loads no tokenizer library.
TOKENIZER_EXPORT_NAMES = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json",
                          "tiktoken": "tokenizer.tiktoken"}


@dataclass
class DataConfig:
    path: str = "data/quickstart/shards"  # shard directory or URL holding index.json
    # the tokenizer file the shards were written with (docs/data.md, "Tokenizers")
    tokenizer: str = "data/quickstart/tokenizer.model"
    tokenizer_kind: Literal["auto", "sentencepiece", "hf", "tiktoken"] = "auto"  # auto: by content
    build: Optional[Literal["stdlib_docs"]] = None  # build the quickstart corpus if path has none
    build_vocab_size: int = 4096
    heldout_fraction: float = field(default=0.02, metadata={"ge": 0, "lt": 1})
    seq_len: int = field(default=256, metadata={"gt": 0})
    # DataLoader workers per rank (0: in the training process)
    num_workers: int = field(default=0, metadata={"ge": 0})
    # samples in the shuffle buffer across a reader's shards (0: off)
    shuffle_buffer: int = field(default=0, metadata={"ge": 0})
    # corrupt shards/samples skipped before the run stops (exit 65)
    max_failures: int = field(default=100, metadata={"ge": 0})
    # a weighted mixture of shard directories to train on instead of `path` (held-out evaluation
    # still reads `path`), one relative weight per path
    mixture_paths: list[str] = field(default_factory=list)
    mixture_weights: list[float] = field(default_factory=list)

    def check(self) -> None:
        """Combinations no data stream can use (one ConfigError naming the field); each field's
        bounds are declared on it (typed_yaml checks them)."""
        if len(self.mixture_weights) != len(self.mixture_paths) or \
                any(w <= 0 for w in self.mixture_weights):
            raise ConfigError(f"data.mixture_weights: need one positive weight per "
                              f"data.mixture_paths entry, got {self.mixture_weights} for "
                              f"{len(self.mixture_paths)} paths")
