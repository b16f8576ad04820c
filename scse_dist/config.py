"""Typed run configuration: dataclasses <-> YAML, `key.sub=value` overrides, validation.

Every field is typed; loading checks names, types and allowed values and fails with one
`ConfigError` that names the offending field (e.g. ``model.recurrence``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

# The model package owns its config (it is copied into exports as remote code); re-exported here.
# check_model_config is the full check (the fields, then the recurrence's own: transitions.py).
from scse_dist.model.config import (  # noqa: F401
    VALUE_BEFORE_FIELD, ConfigError, ModelConfig, resolved_anchor_scale)
from scse_dist.model.transitions import check_model_config  # noqa: F401
from scse_dist.task_registry import TASKS, field_value, unknown_task
# The typed-YAML machinery; apply_overrides and deep_merge are part of this module's interface.
from scse_dist.typed_yaml import _build, _read_yaml, apply_overrides, deep_merge  # noqa: F401


# --------------------------------------------------------------------------- sections


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


@dataclass
class DepthSamplingConfig:
    # fixed: T = model.depth every step. uniform: T ~ U{min, max} (max 0 -> 2*model.depth), the
    # spec's 2..2*T_mean by default. poisson_lognormal: Huginn's scheme, mean model.depth, spread
    # `sigma`, at least `min`.
    kind: Literal["fixed", "uniform", "poisson_lognormal"] = "fixed"
    min: int = 2
    max: int = 0
    sigma: float = 0.5
    # Backpropagate through only the last k loop steps (0: all of them).
    backprop_steps: int = 0


@dataclass
class TrainConfig:
    # Sequences per rank per micro-batch, or auto: the largest power of two dividing
    # global_batch_size / world size that fits in memory, found by probing at start-up
    # (scse_dist.train.micro_batch; needs global_batch_size).
    micro_batch_size: Union[int, Literal["auto"]] = 8
    grad_accum_steps: int = 1
    # Sequences per optimizer step over all ranks; 0 means micro_batch_size * grad_accum_steps *
    # world size. When set, grad_accum_steps is derived from it at start-up (see grad_accum_for),
    # so the global batch, and the loss curve, stay the same at any world size.
    global_batch_size: int = 0
    # micro_batch_size: auto on CPU (no out-of-memory signal there): the most a probe's peak RSS
    # may grow, plus the optimizer state it does not allocate, in GiB. 0: half of MemAvailable
    # at start-up, shared by the node's ranks (the rest for data workers and the page cache).
    micro_batch_memory_gib: float = 0.0
    max_steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # auto: bf16 where the accelerator supports it, fp32 otherwise (CPU).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    zero_stage: int = 1
    # Optional DeepSpeed JSON merged over the generated config (e.g. configs/deepspeed/zero3.json):
    # its values override generated keys, except keys a config field decides (engine._OWNED: batch
    # sizes, clipping, ZeRO stage, precision, lr/betas/weight decay, scheduler), which it may only
    # repeat with the same value (engine.build_ds_config).
    deepspeed_config: Optional[str] = None
    # torch_adamw: torch.optim.AdamW, fused on CUDA (no nvcc or JIT build). deepspeed_fused_adam:
    # DeepSpeed's FusedAdam, which JIT-compiles a CUDA extension at start-up (CUDA only). muon:
    # Muon for the 2-D matrices of prelude, core and coda, AdamW (lr, betas, weight_decay above)
    # for the embedding/head and gains (scse_dist.train.muon); ZeRO stage 0-2.
    optimizer: Literal["torch_adamw", "deepspeed_fused_adam", "muon"] = "torch_adamw"
    # Muon's own settings (train.optimizer: muon). lr in units of spectral norm per step, under
    # the same warmup-cosine schedule; 0.02, momentum 0.95 (Nesterov) and no weight decay are
    # the defaults of Keller Jordan's reference implementation.
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    depth: DepthSamplingConfig = field(default_factory=DepthSamplingConfig)
    log_every: int = 10
    # Loop diagnostics (scse_dist.train.diagnostics: deviation norms, anchor scale, gradient
    # shares) on one fixed held-out batch every this many steps; null: log_every; 0: off.
    diagnostics_every: Optional[int] = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    # A step whose loss or gradient is NaN/Inf on any rank is skipped; this many in a row stop
    # the run (exit status 3) with the last good checkpoint left as it was.
    max_nonfinite_steps: int = 5
    # torch.compile each block's math (regional: one graph for every loop step and depth T).
    compile: bool = False
    # Warm start: an export dir or URL whose weights (only) a new run starts from; a run that
    # has a checkpoint resumes it and ignores this. Strict: every key and shape must match.
    init_from: Optional[str] = None
    init_from_strict: bool = True
    # A run dir with checkpoints: auto resumes the newest intact one (a changed model or data
    # stream is refused); never moves them aside (run_dir/old-<time>/) and starts fresh; require
    # fails when there is nothing to resume.
    resume: Literal["auto", "never", "require"] = "auto"
    # Resume from this checkpoint tag (step-N) instead of the newest; the run dir's newer tags
    # are moved aside (run_dir/old-<time>/checkpoints). For one command line: a requeue with it
    # still set goes back to step-N again.
    resume_from: Optional[str] = None

    def __post_init__(self) -> None:
        if self.resume_from is None:
            return
        if not re.fullmatch(r"step-\d+", self.resume_from):
            raise ConfigError(f"train.resume_from: expected a checkpoint tag like step-40, got "
                              f"{self.resume_from!r}")
        if self.resume == "never":
            raise ConfigError("train.resume_from: contradicts train.resume=never (which starts "
                              "fresh); leave train.resume at auto")

    def micro_batch_candidates(self, world_size: int) -> list[int]:
        """micro_batch_size: auto's candidates at `world_size`: the powers of two that divide the
        global batch's share of one rank, largest first (ConfigError if there is no such share)."""
        if self.global_batch_size % world_size:
            raise ConfigError(f"train.global_batch_size: {self.global_batch_size} is not a multiple "
                              f"of the world size ({world_size}), so train.micro_batch_size: auto "
                              "has no per-rank share to split")
        per_rank = self.global_batch_size // world_size
        return [1 << k for k in range(per_rank.bit_length() - 1, -1, -1) if per_rank % (1 << k) == 0]

    def grad_accum_for(self, world_size: int, micro_batch_size: Optional[int] = None) -> int:
        """Micro-batches per optimizer step at `world_size` ranks (ConfigError if it cannot fit).
        micro_batch_size: auto counts at its largest candidate unless `micro_batch_size` (the
        one chosen) is given."""
        if not self.global_batch_size:
            return self.grad_accum_steps
        micro = micro_batch_size or self.micro_batch_size
        if micro == "auto":
            micro = self.micro_batch_candidates(world_size)[0]
        per_pass = micro * world_size
        if self.global_batch_size % per_pass:
            raise ConfigError(
                f"train.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size ({micro}) x world size ({world_size})")
        accum = self.global_batch_size // per_pass
        if self.grad_accum_steps not in (1, accum):
            raise ConfigError(
                f"train.grad_accum_steps: {self.grad_accum_steps} contradicts "
                f"train.global_batch_size={self.global_batch_size}, which needs {accum} at world "
                f"size {world_size}; leave grad_accum_steps at 1 or set global_batch_size to 0")
        return accum


@dataclass
class EvalConfig:
    depths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 48])
    batch_size: int = 8
    max_batches: int = 0  # 0: the whole held-out split
    after_train: bool = True
    # During training: held-out loss at `depths` every this many steps (0: off), rows of kind
    # "eval" in metrics.jsonl and wandb (docs/training.md, "Evaluation during training").
    every_steps: int = 0
    # During training: continuations of `sample_prompts` every this many steps (0: off), rank 0,
    # `sample_tokens` new tokens each, sampled at `sample_temperature` (0: greedy) with
    # train.seed; rows of kind "sample" in metrics.jsonl and a table in wandb.
    sample_every: int = 0
    sample_prompts: list[str] = field(
        default_factory=lambda: ["The", "Return the", "This module provides"])
    sample_tokens: int = 32
    sample_temperature: float = 0.8
    # During training: the tasks in `downstream_tasks` (registry tasks with totals: lambada,
    # wikitext, hellaswag, piqa, arc_easy, arc_challenge, multiple_choice; files from eval.lambada,
    # eval.wikitext, eval.data.<task>) at `depths` every this many steps (0: off), each on the
    # first `downstream_max_examples` examples of its file (0: all), every rank scoring its
    # share; rows of kind "downstream" in metrics.jsonl and wandb (docs/training.md).
    downstream_every: int = 0
    downstream_tasks: list[str] = field(default_factory=list)
    downstream_max_examples: int = 0
    # Tasks `scse-launch` runs as jobs after training (scse_dist.task_registry; heldout and
    # diagnose read data.path).
    tasks: list[str] = field(default_factory=lambda: ["heldout"])
    wikitext: Optional[str] = None  # wiki.{valid,test}.raw path or URL, for the wikitext task
    lambada: Optional[str] = None  # LAMBADA JSONL or plain text, for the lambada task
    data: dict[str, str] = field(default_factory=dict)  # task -> its file, for tasks with no field above
    stride: int = 0  # wikitext sliding-window stride; 0 means data.seq_len // 2
    # Resources of each evaluation job scse-launch submits (read into launch.backends.Resources;
    # named slurm_* from before other backends, kept); GPUs 0 evaluates on CPU.
    slurm_gpus: int = 0
    slurm_cpus: int = 1
    slurm_time_min: int = 120
    slurm_partition: Optional[str] = None

    def __post_init__(self) -> None:
        for i, task in enumerate(self.tasks):
            if task not in TASKS:
                raise ConfigError(f"eval.tasks[{i}]: {unknown_task(task)}")
            need = TASKS[task].data_field
            if need and not field_value(self, need):
                raise ConfigError(f"eval.{need}: eval.tasks lists {task!r}, so set eval.{need} "
                                  "to its data file")
        if self.sample_every and not all(p.strip() for p in self.sample_prompts or [""]):
            raise ConfigError("eval.sample_prompts: need at least one prompt, none empty, when "
                              "eval.sample_every is set")
        if self.sample_tokens < 1:
            raise ConfigError(f"eval.sample_tokens: must be >= 1, got {self.sample_tokens}")
        for name in ("stride", "slurm_gpus", "every_steps", "max_batches", "sample_every",
                     "sample_temperature", "downstream_every", "downstream_max_examples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"eval.{name}: must be >= 0, got {getattr(self, name)}")
        self._check_downstream()
        if self.slurm_cpus < 1 or self.slurm_time_min < 1:
            raise ConfigError("eval.slurm_cpus, eval.slurm_time_min: must be >= 1, got "
                              f"{self.slurm_cpus}, {self.slurm_time_min}")

    def _check_downstream(self) -> None:
        able = [name for name, task in TASKS.items() if task.downstream]
        for i, task in enumerate(self.downstream_tasks):
            where = f"eval.downstream_tasks[{i}]"
            if task not in TASKS:
                raise ConfigError(f"{where}: {unknown_task(task)}")
            if not TASKS[task].downstream:
                raise ConfigError(f"{where}: {task!r} does not run during training (held-out "
                                  f"loss: eval.every_steps); the tasks that do: {', '.join(able)}")
            if task in self.downstream_tasks[:i]:
                raise ConfigError(f"{where}: {task!r} is listed twice")
            need = TASKS[task].data_field
            if need and not field_value(self, need):
                raise ConfigError(f"eval.{need}: eval.downstream_tasks lists {task!r}, so set "
                                  f"eval.{need} to its data file")
        if self.downstream_every and not self.downstream_tasks:
            raise ConfigError("eval.downstream_tasks: eval.downstream_every is set, so name the "
                              f"tasks to run (any of {', '.join(able)})")


@dataclass
class WandbConfig:
    enabled: bool = True
    # offline by default: runs sync later with `wandb sync`; there is often no network.
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "scse-dist"
    entity: Optional[str] = None
    group: Optional[str] = None


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
    if cfg.eval.downstream_every and t.zero_stage == 3:
        # the scorer applies the LM head outside the forward, where ZeRO-3 keeps it partitioned
        raise ConfigError("eval.downstream_every: downstream tasks during training run at ZeRO "
                          "stage 0, 1 or 2, not train.zero_stage 3; evaluate the checkpoints "
                          "with scse-eval instead")
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
