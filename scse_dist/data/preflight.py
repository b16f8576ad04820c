"""A training run's inputs and data, checked before torch or DeepSpeed is imported (one line, exit
65 or 66): check_run_data, which scse-train, scse-launch and scse-study --dry-run call; then the
data step (check_then_build). train() reads the same again.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig
from scse_dist.config_paths import check_inputs
from scse_dist.data.config import DataConfig
from scse_dist.data.index import check_tokenizer, read_index
from scse_dist.data.quickstart import check_build, data_step, needs_build
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


def check_then_build(cfg: RunConfig, config_path: Optional[str] = None,
                     overrides: Sequence[str] = (), then: Callable[[], object] = lambda: None,
                     build: bool = True) -> bool:
    """The data step of a run started here (scse-train, scse-launch --local): check_run_data, the
    caller's checks that may import torch (`then`), then, with `build`, the global batch at the
    launcher's world and data.build's build where it is due (rank 0 builds, the others wait).
    Returns whether data.build writes the data."""
    building = check_run_data(cfg, config_path, overrides)
    then()
    if build:
        from scse_dist.distributed import launcher_world  # imports torch

        world_size, world_from = launcher_world(os.environ)
        cfg.train.batch.grad_accum_for(world_size, world_from=world_from)
        if building:
            data_step(cfg.data)
    return building
