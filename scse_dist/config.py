"""Typed run configuration: dataclasses <-> YAML, `key.sub=value` overrides, validation.

Every field is typed; loading checks names, types and allowed values and fails with one
`ConfigError` that names the offending field (e.g. ``model.recurrence``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.config_paths import forget_overridden, note_origins, resolve_paths

# Each section's dataclass sits beside the code it configures; this module composes them into
# RunConfig and checks what spans them. It re-exports nothing: import a name from its module.
from scse_dist.data.config import DataConfig
from scse_dist.eval.config import EvalConfig
from scse_dist.launch.config import LaunchConfig
from scse_dist.model.config import VALUE_BEFORE_FIELD, ModelConfig
from scse_dist.model.transitions import check_model_config, resolved_anchor_scale, transition_for
from scse_dist.resources import Resources
from scse_dist.train.batch_config import BatchConfig
from scse_dist.train.config import TrainConfig
from scse_dist.train.depth_config import largest_trained_depth
from scse_dist.train.engine_config import EngineConfig
from scse_dist.train.metrics_config import TensorBoardConfig, WandbConfig
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule_config import ScheduleConfig
from scse_dist.typed_yaml import (
    ConfigError,
    _parse_scalar,
    _read_one,
    _read_yaml,
    apply_overrides,
    build_dataclass,
    old_name_notice,
)

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
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    # What the run's training job asks of a batch system (scse-launch); training never reads it.
    resources: Resources = field(default_factory=Resources)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def run_dir(self) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.name}"


# --------------------------------------------------------------------------- validation


def _check_consistency(cfg: RunConfig) -> None:
    """The whole config: each section's own check (model first), then what spans sections."""
    check_model(cfg.model)
    cfg.data.check()
    cfg.train.check()
    cfg.eval.check()
    cfg.tensorboard.check()
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds "
                          f"model.max_seq_len={cfg.model.max_seq_len}")
    cfg.train.batch.check_tokens(cfg.data.seq_len)
    if cfg.resources.problem():
        raise ConfigError(f"resources: {cfg.resources.problem()}")
    _check_depth_loss(cfg)
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name: must be a non-empty run name without '/', got {cfg.name!r}")


def check_model(model: ModelConfig) -> None:
    """The model's own check (transitions.check_model_config) as a ConfigError: the model
    imports nothing of the config layer, so its checks raise a plain ValueError."""
    try:
        check_model_config(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_depth_loss(cfg: RunConfig) -> None:
    """train.loss.depth against the model's loop and the trained depths."""
    loss = cfg.train.loss.depth
    if loss.kind == "off":
        return
    if not transition_for(cfg.model).loops:
        raise ConfigError(f"train.loss.depth: recurrence={cfg.model.recurrence} runs one fixed "
                          "depth, so there is no shorter depth to train; set kind: off")

    deepest = largest_trained_depth(cfg.train.depth, cfg.model.depth)
    if loss.short >= deepest:
        raise ConfigError(f"train.loss.depth.short: {loss.short} is not below the largest "
                          f"trained depth {deepest} (train.depth, model.depth), so it would never "
                          "apply; lower it")


# --------------------------------------------------------------------------- loading


CB = "train.callbacks"
# Fields renamed since: old name -> new dotted name, still loaded with one notice per name and
# process. An old name that is now a section is renamed only where it holds a value, not a
# mapping; those come first, so the fields moved into them find a section. `<task>` stands for
# each key of the old mapping.
RENAMED_FIELDS = {"eval.wikitext": "eval.task_settings.wikitext.path",
                  "eval.lambada": "eval.task_settings.lambada.path",
                  "eval.stride": "eval.task_settings.wikitext.stride",
                  "eval.data.<task>": "eval.task_settings.<task>.path",
                  "eval.slurm_gpus": "eval.resources.gpus_per_node",
                  "eval.slurm_cpus": "eval.resources.cpus_per_task",
                  "eval.slurm_time_min": "eval.resources.time_min",
                  "eval.slurm_partition": "eval.resources.partition",
                  "train.optimizer": "train.optimizer.kind",
                  "train.schedule": "train.schedule.kind",
                  "train.z_loss": "train.loss.z_loss",
                  "train.depth_loss": "train.loss.depth",
                  "train.max_retries": "launch.max_retries",  # read by the launcher alone
                  "train.start.max_retries": "launch.max_retries",
                  "train.checkpoint_every": "train.checkpoint.every",
                  "train.keep_checkpoints": "train.checkpoint.keep",
                  # the built-in callbacks' settings, now their train.callbacks entries'
                  "train.max_nonfinite_steps": f"{CB}.nonfinite.init_args.max_in_a_row",
                  "train.spike_skip.enabled": f"{CB}.spike_skip.enabled",
                  **{f"train.spike_skip.{name}": f"{CB}.spike_skip.init_args.{name}"
                     for name in ("metric", "k", "window", "warmup", "max_in_a_row")},
                  "train.diagnostics_every": f"{CB}.diagnostics.init_args.every_steps",
                  "profile.enabled": f"{CB}.profiler.enabled",
                  **{f"profile.{name}": f"{CB}.profiler.init_args.{name}"
                     for name in ("start_step", "steps", "warmup_steps", "ranks", "record_shapes",
                                  "profile_memory", "with_stack", "flops_step")},
                  "eval.every_steps": f"{CB}.heldout_eval.init_args.every_steps",
                  "eval.sample_every": f"{CB}.samples.init_args.every_steps",
                  **{f"eval.sample_{name}": f"{CB}.samples.init_args.{name}"
                     for name in ("prompts", "tokens", "temperature")},
                  "eval.downstream_every": f"{CB}.downstream.init_args.every_steps",
                  "eval.downstream_tasks": f"{CB}.downstream.init_args.tasks",
                  "eval.downstream_max_examples": f"{CB}.downstream.init_args.max_examples",
                  # the flat train.* fields of the sections that own them now
                  **{f"train.{f.name}": f"train.{section}.{f.name}"
                     for section, cls in (("batch", BatchConfig), ("engine", EngineConfig),
                                          ("optimizer", OptimizerConfig),
                                          ("schedule", ScheduleConfig), ("start", StartConfig))
                     for f in dataclasses.fields(cls) if f.name != "kind"}}

def renamed_key(key: str, value: Any = None) -> str:
    """The current name of dotted key `key` (an override's, a study's) given `value`: a
    RENAMED_FIELDS old name, or a key inside one, moves to its new name (with the notice)."""
    for old, new in RENAMED_FIELDS.items():
        if old.endswith(EACH):  # eval.data.<task>: the task's key moves
            prefix = old.removesuffix(EACH) + "."
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                old_name_notice(old, new)
                return new.replace(EACH[1:], key[len(prefix):])
            continue
        if new.startswith(old + "."):  # a name that is now a section: only a value moves
            if key == old and not isinstance(value, dict):
                old_name_notice(old, new)
                return new
        elif key == old or key.startswith(old + "."):
            old_name_notice(old, new)
            return new + key[len(old):]
    return key


def renamed_overrides(overrides: list[str]) -> list[str]:
    """`key=value` overrides with their keys renamed (renamed_key)."""
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        out.append(f"{renamed_key(key.strip(), _parse_scalar(raw))}{sep}{raw}" if sep else item)
    return out


def _rename_old_fields(values: dict) -> dict:
    """Move the values of RENAMED_FIELDS' old names to their new ones, in place (the new name
    wins when both are given), saying so once per name on stderr; returns `values`."""
    train = values.get("train")
    if isinstance(train, dict) and isinstance(train.get("callbacks"), list):
        if train["callbacks"]:  # keyed by class path
            old_name_notice("train.callbacks as a list", "a mapping of name: entry")
        train["callbacks"] = {_listed_name(e, train["callbacks"][:i]): e
                              for i, e in enumerate(train["callbacks"])}
    for old, new in RENAMED_FIELDS.items():
        *path, leaf = old.removesuffix(EACH).split(".")
        node: Any = values
        parent = None
        for part in path:
            parent, node = node, node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        if new.startswith(old + ".") and isinstance(node[leaf], dict):
            continue  # already the section
        value = node.pop(leaf)
        if not node and parent is not None:  # a section whose fields all moved (profile) goes
            del parent[path[-1]]
        if old.endswith(EACH):  # a mapping whose every key moves
            if not isinstance(value, dict):
                raise ConfigError(f"{old.removesuffix(EACH)}: expected a mapping, got {value!r}")
            for key, each in value.items():
                _set_new(values, new.replace(EACH[1:], str(key)), each)
        else:
            _set_new(values, new, value)
        old_name_notice(old, new)
    return values


def _listed_name(entry: Any, before: list) -> str:
    """A train.callbacks list entry's name: its class path (`#2`, ... for a repeat)."""
    path = entry.get("class_path", "") if isinstance(entry, dict) else ""
    repeats = sum(isinstance(e, dict) and e.get("class_path", "") == path for e in before)
    return f"{path}#{repeats + 1}" if repeats else str(path)


EACH = ".<task>"  # an old name ending so names every key of a mapping (RENAMED_FIELDS)


def _set_new(values: dict, new: str, value: Any) -> None:
    """values' dotted `new` set to `value` unless given already (the new name wins)."""
    *new_path, new_leaf = new.split(".")
    target = values
    for part in new_path:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{'.'.join(new_path)}: expected a mapping")
    target.setdefault(new_leaf, value)


def read_config_file(path: Path, origins: Optional[dict[str, Path]] = None) -> dict:
    """A config file's values (its `base:` chain overlaid), each file's old names renamed before
    the next overlays it, so a newer file's value wins whichever names either uses. `origins`,
    if given, gets the file that set each input path (config_paths.resolve_paths' input)."""

    def normalize(values: dict, file: Path) -> None:
        _rename_old_fields(values)
        if origins is not None:
            note_origins(values, file, origins)

    return _read_yaml(path, normalize=normalize)


def config_from_dict(values: dict) -> RunConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got "
                          f"{type(values).__name__}")
    _rename_old_fields(values)
    cfg = build_dataclass(RunConfig, values)
    _check_consistency(cfg)
    # A saved config names what ran, so "auto" is written down as what it meant here.
    cfg.model.anchor_scale = resolved_anchor_scale(cfg.model)
    batch = cfg.train.batch
    if batch.global_batch_tokens:  # the trainer counts the batch in sequences
        batch.global_batch_size = batch.global_batch_tokens // cfg.data.seq_len
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or defaults when `path` is None), apply overrides, validate; an error
    names where to fix it: the file, or the command line when the file alone is free of it."""
    origins: dict[str, Path] = {}
    values = read_config_file(Path(path), origins) if path is not None else {}
    overrides = renamed_overrides(overrides or [])
    try:
        given = apply_overrides(copy.deepcopy(values), overrides)
        # the file's relative input paths against its directory; the command line's as typed
        forget_overridden(origins, (item.split("=", 1)[0].strip() for item in overrides))
        resolve_paths(given, origins)
        return config_from_dict(given)
    except ConfigError as exc:
        source = _error_source(exc, path, values, overrides or [])
        raise ConfigError(f"{exc} ({source})" if source else str(exc)) from None


# A saved run config written before a field existed ran with that field's default of then.
SAVED_BEFORE = {"model": VALUE_BEFORE_FIELD}


def read_saved_config(saved: str | Path | dict) -> dict:
    """The values of a config a run saved (a run dir's or an export's config.yaml, a checkpoint
    tag's config.json, or such values already read), the one reader of them: old names renamed
    (one notice each), and a model field it lacks at the value it had when the run was made
    (SAVED_BEFORE); another field it lacks stays absent (its reader's default)."""
    if isinstance(saved, dict):
        values = saved
    elif Path(saved).suffix == ".json":  # JSON as JSON: YAML 1.1 would read 1e-05 as a string
        try:
            values = json.loads(Path(saved).read_text())
        except ValueError as exc:
            raise ConfigError(f"config file {str(saved)!r}: not valid JSON ({exc})") from None
    else:
        values = _read_one(Path(saved))
    _rename_old_fields(values)
    for section, fields in SAVED_BEFORE.items():
        if isinstance(values.get(section), dict):
            for name, value in fields.items():
                values[section].setdefault(name, value)
    return values


def load_saved_config(saved: str | Path | dict) -> RunConfig:
    """read_saved_config's values as a RunConfig (today's default for what they lack)."""
    try:
        return config_from_dict(read_saved_config(saved))
    except ConfigError as exc:
        if isinstance(saved, dict):
            raise
        raise ConfigError(f"{exc} (in {saved})") from None


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
    """The resolved config as YAML (what config.yaml of a run holds; `scse-train
    --print-config`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
