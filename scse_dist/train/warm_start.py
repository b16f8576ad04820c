"""Warm starts: `train.start.init_from` loads an export's weights, and nothing else, into a new run
(before DeepSpeed wraps the model, so ZeRO-3 partitions them). A run with a checkpoint resumes it
instead. Strict by default: a missing, unexpected or reshaped key stops the run naming it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec

from scse_dist.checkpoint.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    describe_mismatch,
    fetched,
    is_remote,
    not_an_export,
    read_export_weights,
    weights_mismatch,
)
from scse_dist.checkpoint.resume import warm_start_changes
from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.cli_errors import InputError
from scse_dist.config import config_to_dict, load_saved_config
from scse_dist.model.config import ModelConfig
from scse_dist.typed_yaml import ConfigError

if TYPE_CHECKING:
    from torch import nn


def _weights_url(source: str) -> str:
    source = source.rstrip("/")
    return source if source.endswith(".safetensors") else f"{source}/{WEIGHTS_NAME}"


def check_init_from(source: str) -> None:
    """FileNotFoundError naming train.start.init_from unless a local source is an export (or its
    .safetensors file); a URL is checked when it is read."""
    url = _weights_url(source)
    if is_remote(url):
        return
    path = Path(fsspec.core.strip_protocol(url))
    if path.is_file():
        return
    reason = not_an_export(path.parent) if path.name == WEIGHTS_NAME else None
    raise FileNotFoundError(f"train.start.init_from: {reason or f'{str(path)!r} does not exist'}")


def read_init_weights(source: str) -> dict:
    """The export's tensors; a URL's model.safetensors is downloaded to a temp dir first."""
    url = _weights_url(source)
    if not is_remote(url):
        check_init_from(source)
        return read_export_weights(Path(fsspec.core.strip_protocol(url)))
    folder, name = url.rsplit("/", 1)
    try:
        with fetched(folder, (name,), required=(name,)) as tmp:
            return read_export_weights(Path(tmp) / name)
    except FileNotFoundError:
        raise FileNotFoundError(f"train.start.init_from: {url} does not exist") from None


def check_init_config(start: StartConfig, model: ModelConfig) -> None:
    """ConfigError (one line, exit 2) when this run's `model:` differs from the export's saved
    config in a field that changes what the weights compute (WARM_START_MODEL_FIELDS may differ).
    An export without config.yaml (a bare .safetensors file) is not compared."""
    source = start.init_from
    if not source:
        return
    folder = _weights_url(source).rsplit("/", 1)[0]
    remote = is_remote(folder)
    if not remote:
        check_init_from(source)
    with fetched(folder, (CONFIG_NAME,), required=()) if remote else \
            contextlib.nullcontext(fsspec.core.strip_protocol(folder)) as where:
        path = Path(where) / CONFIG_NAME
        saved = load_saved_config(path) if path.is_file() else None
    if saved is None:
        return
    changes = warm_start_changes(config_to_dict(saved), {"model": config_to_dict(model)})
    if changes:
        raise ConfigError(f"train.start.init_from: {source} is another model than this run's: "
                          f"{'; '.join(changes)} (export -> run); start from its config with "
                          f"`base: {path}`")


def init_from_export(model: "nn.Module", source: str, strict: bool = True) -> list[str]:
    """Copy the export's weights into `model`; return what was skipped (non-strict only)."""
    state = read_init_weights(source)
    problems = weights_mismatch(model.state_dict(), state)
    if problems and strict:
        raise InputError(f"train.start.init_from: {source} does not fit this model; "
                         f"{describe_mismatch(problems)} (train.start.init_from_strict: false "
                         "loads what fits)")
    expected = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in expected and v.shape == expected[k].shape}
    model.load_state_dict(fitting, strict=False)
    return [f"{label} {item}" for label, items in problems.items() for item in items]


def maybe_init_from(model: "nn.Module", train_cfg, has_checkpoint: bool, rank0: bool) -> None:
    """Apply `train.start.init_from` to a new run (every rank loads: ZeRO-3 partitions each rank's
    copy)."""
    source = train_cfg.start.init_from
    if not source:
        return
    if has_checkpoint:
        if rank0:
            print(f"train.start.init_from ignored: resuming this run's checkpoint instead of "
                  f"{source}", flush=True)
        return
    skipped = init_from_export(model, source, train_cfg.start.init_from_strict)
    if rank0:
        print(f"warm start from {source}: weights only (new optimizer, schedule, data position)"
              + (f"; skipped {len(skipped)}: {', '.join(skipped)}" if skipped else ""), flush=True)
