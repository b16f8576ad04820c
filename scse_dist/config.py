"""Typed run configuration: dataclasses <-> YAML, `key.sub=value` overrides, validation.

Every field is typed; loading checks names, types and allowed values and fails with one
`ConfigError` that names the offending field (e.g. ``model.recurrence``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# The model package owns its config (it is copied into exports as remote code); re-exported here.
# check_model_config is the full check (the fields, then the recurrence's own: transitions.py).
from scse_dist.model.config import (  # noqa: F401
    VALUE_BEFORE_FIELD, ConfigError, ModelConfig, resolved_anchor_scale)
from scse_dist.model.transitions import check_model_config  # noqa: F401
# Each section's dataclass sits beside the package it configures (below it: a leaf the package's
# __init__ does not weigh down); this module composes them into RunConfig and re-exports them.
from scse_dist.data.config import DataConfig
from scse_dist.eval.config import EvalConfig
from scse_dist.train.config import DepthSamplingConfig, TrainConfig, WandbConfig  # noqa: F401
# The typed-YAML machinery; apply_overrides and deep_merge are part of this module's interface.
from scse_dist.typed_yaml import _build, _read_yaml, apply_overrides, deep_merge  # noqa: F401


# --------------------------------------------------------------------------- the run config


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @property
    def run_dir(self) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.name}"


# --------------------------------------------------------------------------- validation


def _check_consistency(cfg: RunConfig) -> None:
    m, t, d = cfg.model, cfg.train, cfg.train.depth
    check_model_config(m)
    positive = {
        "data.seq_len": cfg.data.seq_len,
        "train.micro_batch_size": 1 if t.micro_batch_size == "auto" else t.micro_batch_size,
        "train.grad_accum_steps": t.grad_accum_steps, "train.max_steps": t.max_steps,
        "train.log_every": t.log_every, "train.checkpoint_every": t.checkpoint_every,
        "train.keep_checkpoints": t.keep_checkpoints, "train.depth.min": d.min,
        "train.max_nonfinite_steps": t.max_nonfinite_steps,
        "eval.batch_size": cfg.eval.batch_size,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{name}: must be > 0, got {value}")
    for name, value in {"train.warmup_steps": t.warmup_steps,
                        "train.global_batch_size": t.global_batch_size,
                        "train.micro_batch_memory_gib": t.micro_batch_memory_gib,
                        "train.depth.backprop_steps": d.backprop_steps,
                        "train.diagnostics_every": t.diagnostics_every or 0,
                        "eval.max_batches": cfg.eval.max_batches}.items():
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0, got {value}")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"train.zero_stage: must be 0, 1, 2 or 3, got {t.zero_stage}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio: must lie in [0, 1], got {t.min_lr_ratio}")
    if t.init_from is not None and not t.init_from.strip():
        raise ConfigError("train.init_from: an export dir or URL, or null; got an empty string")
    if t.lr <= 0:
        raise ConfigError(f"train.lr: must be > 0, got {t.lr}")
    _check_muon(t)
    _check_auto_micro_batch(t)
    if d.kind == "uniform" and d.max and d.max < d.min:
        raise ConfigError(f"train.depth.max: {d.max} is below train.depth.min={d.min}")
    if d.sigma <= 0:
        raise ConfigError(f"train.depth.sigma: must be > 0, got {d.sigma}")
    if any(x <= 0 for x in cfg.eval.depths) or not cfg.eval.depths:
        raise ConfigError(f"eval.depths: need a non-empty list of depths >= 1, got {cfg.eval.depths}")
    if len(cfg.data.mixture_weights) != len(cfg.data.mixture_paths) or \
            any(w <= 0 for w in cfg.data.mixture_weights):
        raise ConfigError(f"data.mixture_weights: need one positive weight per data.mixture_paths "
                          f"entry, got {cfg.data.mixture_weights} for {len(cfg.data.mixture_paths)} paths")
    for name in ("num_workers", "shuffle_buffer", "max_failures"):
        if getattr(cfg.data, name) < 0:
            raise ConfigError(f"data.{name}: must be >= 0, got {getattr(cfg.data, name)}")
    if not 0.0 <= cfg.data.heldout_fraction < 1.0:
        raise ConfigError(f"data.heldout_fraction: must lie in [0, 1), got {cfg.data.heldout_fraction}")
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name: must be a non-empty run name without '/', got {cfg.name!r}")


def _check_auto_micro_batch(t: TrainConfig) -> None:
    if t.micro_batch_size != "auto":
        return
    if not t.global_batch_size:  # the batch that auto keeps while it picks the split
        raise ConfigError("train.micro_batch_size: auto needs train.global_batch_size (the batch "
                          "per optimizer step it keeps while choosing the micro-batch); set it, "
                          "e.g. train.global_batch_size=64")
    if t.grad_accum_steps != 1:
        raise ConfigError(f"train.grad_accum_steps: {t.grad_accum_steps} with "
                          "train.micro_batch_size: auto, which derives it; leave it at 1")


def _check_muon(t: TrainConfig) -> None:
    if t.muon_lr <= 0:
        raise ConfigError(f"train.muon_lr: must be > 0, got {t.muon_lr}")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum: must lie in [0, 1), got {t.muon_momentum}")
    if t.muon_weight_decay < 0:
        raise ConfigError(f"train.muon_weight_decay: must be >= 0, got {t.muon_weight_decay}")
    if t.optimizer == "muon" and t.zero_stage == 3:
        # DeepSpeed's ds_to_universal (resume at another world size) has no Muon state at stage 3
        raise ConfigError("train.zero_stage: train.optimizer: muon works at ZeRO stage 0, 1 or 2, "
                          "not 3; set train.zero_stage: 2 (it partitions gradients and optimizer "
                          "state too) or use torch_adamw")


# --------------------------------------------------------------------------- loading


def config_from_dict(values: dict) -> RunConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(values).__name__}")
    cfg = _build(RunConfig, values)
    _check_consistency(cfg)
    # A saved config names what ran, so "auto" is written down as what it meant here.
    cfg.model.anchor_scale = resolved_anchor_scale(cfg.model)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or defaults when `path` is None), apply overrides, validate.

    An error names where to fix it: the file, or the command line when the file alone is free
    of it (so a typo in an override is not blamed on the file)."""
    values = _read_yaml(Path(path)) if path is not None else {}
    try:
        return config_from_dict(apply_overrides(copy.deepcopy(values), overrides or []))
    except ConfigError as exc:
        source = _error_source(exc, path, values, overrides or [])
        raise ConfigError(f"{exc} ({source})" if source else str(exc)) from None


# A saved run config (a checkpoint's or an export's) written before a field existed ran with the
# behaviour that field's default had then, not with today's default.
SAVED_BEFORE = {"model": VALUE_BEFORE_FIELD}


def load_saved_config(path: str | Path) -> RunConfig:
    """load_config for the config a run saved (config.yaml, config.json): a field it lacks takes
    the value it had when the run was made (SAVED_BEFORE), else today's default."""
    values = _read_yaml(Path(path))
    for section, fields in SAVED_BEFORE.items():
        if isinstance(values.get(section), dict):
            for name, value in fields.items():
                values[section].setdefault(name, value)
    try:
        return config_from_dict(values)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {path})") from None


def _error_source(exc: ConfigError, path: str | Path | None, values: dict,
                  overrides: list[str]) -> str:
    """'in FILE' when the file alone has the same error; else 'on the command line: ...' with the
    overrides of the field the error names (all of them when it names none)."""
    if overrides:
        try:
            config_from_dict(values)
        except ConfigError as without:
            if str(without) == str(exc) and path is not None:
                return f"in {path}"
        field = str(exc).split(":", 1)[0]
        named = [o for o in overrides if _same_field(o.split("=", 1)[0].strip(), field)]
        return "on the command line: " + " ".join(named or overrides)
    return f"in {path}" if path is not None else ""


def _same_field(key: str, field: str) -> bool:
    """Whether override key `key` sets `field` or a section holding it, or a field inside it."""
    return key == field or field.startswith(key + ".") or key.startswith(field + ".")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what config.yaml of a run holds; `scse-train --print-config`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
