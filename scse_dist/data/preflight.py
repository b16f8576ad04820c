"""A training run's inputs and data, checked before torch or DeepSpeed is imported (one line, exit
65 or 66): check_run_data, which scse-train, scse-launch and scse-study --dry-run call. train()
reads the same again.
"""

from __future__ import annotations

from typing import Optional, Sequence

from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig
from scse_dist.config_paths import check_inputs
from scse_dist.data.config import DataConfig
from scse_dist.data.index import check_tokenizer, read_index
from scse_dist.data.quickstart import check_build, needs_build
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.model.config import ModelConfig


def load_run_tokenizer(data: DataConfig, model: ModelConfig) -> Tokenizer:
    """data.tokenizer, loaded; InputError if it has more pieces than the model has embeddings."""
    tokenizer = Tokenizer.load(data.tokenizer, data.tokenizer_kind)
    if tokenizer.vocab_size > model.vocab_size:
        raise InputError(f"data.tokenizer: {data.tokenizer} has {tokenizer.vocab_size} tokens, "
                         f"more than model.vocab_size={model.vocab_size}")
    return tokenizer


def check_run_data(cfg: RunConfig, config_path: Optional[str] = None,
                   overrides: Sequence[str] = ()) -> bool:
    """Every input file the config names exists (config_paths.check_inputs); the build rule;
    then, unless data.build will write them (returns whether), that data.path holds shards and
    data.tokenizer loads, fits the model and wrote them. (The training stream reads the mixture
    paths' shards.)"""
    check_inputs(cfg)
    check_build(cfg.data, config_path, overrides)
    if needs_build(cfg.data):  # FileNotFoundError when missing and nothing builds it
        if cfg.data.build_vocab_size > cfg.model.vocab_size:
            raise InputError(f"data.build_vocab_size={cfg.data.build_vocab_size}: the tokenizer "
                             f"the build trains has more pieces than model.vocab_size="
                             f"{cfg.model.vocab_size}")
        return True
    tokenizer = load_run_tokenizer(cfg.data, cfg.model)
    check_tokenizer(cfg.data.path, read_index(cfg.data.path), tokenizer.sha256)
    return False
