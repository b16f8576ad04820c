"""What a start resumes from, decided before DeepSpeed loads anything: `plan_resume`.

Rank 0 decides and broadcasts, so every rank loads the same tag or raises the same one-line error.
train.start.resume / resume_from / branch_from (docs/config.md), the tag verified against its
manifest with fallback to the newest intact older one, and the tag's recorded config compared with
this run's: a changed model or token stream is refused (docs/checkpoints.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from scse_dist.atomic import atomic_write_text
from scse_dist.checkpoint.manifest import (
    CONFIG_NAME,
    MANIFEST_NAME,
    TAG_PREFIX,
    tag_files,
    verify_tag,
)
from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.checkpoint.tags import (
    TMP_PREFIX,
    checkpoint_dir,
    list_checkpoints,
    remove_partial_saves,
    tag_for,
)
from scse_dist.cli_errors import InputError
from scse_dist.config import read_saved_config
from scse_dist.config_paths import comparable
from scse_dist.distributed import is_rank0
from scse_dist.run_dir import CHECKPOINTS_NAME, OUTPUT_NAMES
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.typed_yaml import ConfigError

# Moved aside by `train.start.resume: never` (the new run would append to or overwrite them).
PREVIOUS_RUN_FILES = OUTPUT_NAMES
# Fields that make a checkpoint another model or another token stream; everything else may change
# (world size and the batch split: resume_if_present and TokenStream.resume).
REFUSED_PREFIXES = ("model.",)
REFUSED_FIELDS = {"data.path", "data.tokenizer", "data.heldout_fraction",
                  "data.shuffle_buffer", "data.mixture_paths", "data.mixture_weights", "train.seed"}
# A model field that changes memory use, not the weights.
ALLOWED_MODEL_FIELDS = {"model.activation_checkpointing"}
# What a warm start (train.start.init_from) may change besides: the nominal loop depth a
# continuation trains towards, the init of weights the export lacks, the training-only loss term;
# and the sizes, which always change a weight's shape or name (the weights check owns those).
WARM_START_MODEL_FIELDS = ALLOWED_MODEL_FIELDS | {
    "model.depth", "model.init_std", "model.loop_stability", "model.vocab_size", "model.d_model",
    "model.ffn_hidden", "model.n_prelude", "model.n_core", "model.n_coda"}


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def is_refused(field: str) -> bool:
    if field in ALLOWED_MODEL_FIELDS:
        return False
    return field in REFUSED_FIELDS or field.startswith(REFUSED_PREFIXES)


def refused_changes(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for every refused field that differs (absent on one side too);
    `saved` as read_saved_config reads it."""
    old, new = _flatten(saved), _flatten(current)
    missing = "<absent>"
    return [f"{name}: {old.get(name, missing)!r} -> {new.get(name, missing)!r}"
            for name in sorted(set(old) | set(new))
            if is_refused(name) and comparable(name, old.get(name, missing))
            != comparable(name, new.get(name, missing))] + _regrouped(saved, current)


def warm_start_changes(saved: dict, current: dict) -> list[str]:
    """'field: export -> run' for every model field of `current` (a run config's dict) that differs
    from `saved` (the export's, as load_saved_config fills it) and changes what the weights
    compute: refused_changes' model fields less WARM_START_MODEL_FIELDS."""
    return [change for change in refused_changes({"model": saved["model"]},
                                                 {"model": current["model"]})
            if change.split(":", 1)[0] not in WARM_START_MODEL_FIELDS]


def _regrouped(saved: dict, current: dict) -> list[str]:
    """train.optimizer's own refusal (OptimizerConfig.regrouping): a changed lr_mult that splits
    the optimizer's param groups differently."""
    old, new = (d.get("train", {}).get("optimizer", {}).get("lr_mult") or {}
                for d in (saved, current))
    problem = OptimizerConfig(lr_mult=new).regrouping(old)
    return [problem] if problem else []


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def choose_tag(root: Path) -> Optional[str]:
    """The tag to resume: the one `latest` names if intact, else the newest intact older one.
    None when there is no `latest`; InputError when no tag is intact."""
    if not (root / "latest").is_file():
        return None
    named = (root / "latest").read_text().strip()
    older = [p.name for p in reversed(list_checkpoints(root.parent)) if p.name < named]
    problems = []
    for tag in [named, *older]:
        status = verify_tag(root / tag)
        if status.intact:
            if not status.has_manifest:
                _warn(f"checkpoint {tag} has no manifest (saved by an older scse-dist): not "
                      "verified")
            return tag
        nxt = next((t for t in older if t < tag), None)
        if nxt:  # the last one broken: the error below says it, once
            _warn(f"checkpoint {tag}: {status.problem}; falling back to {nxt}")
        problems.append(f"{tag}: {status.problem}")
    raise InputError(f"{root}: no intact checkpoint to resume ({'; '.join(problems)}); restore the "
                     "files, or start fresh with train.start.resume=never (moves these aside) or "
                     "another name")


def _move_previous_run(run_dir: Path) -> Optional[Path]:
    present = [run_dir / name for name in PREVIOUS_RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    aside = run_dir / time.strftime("old-%Y%m%d-%H%M%S")
    aside.mkdir()
    for path in present:
        path.rename(aside / path.name)
    return aside


def chosen_tag(resume_from: str, run_dir: Path, remote: bool) -> str:
    """train.start.resume_from: that tag, verified, made `latest`; the newer tags moved aside
    (pruning would otherwise keep them over the new ones)."""
    root = checkpoint_dir(run_dir)
    if remote:
        raise ConfigError("train.start.resume_from: not supported with a remote output_dir "
                          "(only the remote `latest` is fetched); copy the run dir locally to "
                          "resume from it")
    want = tag_for(int(resume_from.split("-")[1]))
    available = [p.name for p in list_checkpoints(run_dir)]
    if want not in available:
        raise ConfigError(f"train.start.resume_from: {run_dir} has no checkpoint "
                          f"{resume_from}; available: {', '.join(available) or 'none'}")
    status = verify_tag(root / want)
    if not status.intact:
        raise InputError(f"train.start.resume_from: checkpoint {want}: {status.problem}")
    newer = [root / t for t in available if t > want]
    if newer:
        aside = run_dir / time.strftime("old-%Y%m%d-%H%M%S") / CHECKPOINTS_NAME
        aside.mkdir(parents=True, exist_ok=True)
        for path in newer:
            path.rename(aside / path.name)
        print(f"train.start.resume_from={resume_from}: moved the newer checkpoints "
              f"{', '.join(p.name for p in newer)} to {aside}", flush=True)
    atomic_write_text(root / "latest", want)  # a kill before the next save resumes it again
    return want


def branch_source(spec: str) -> Path:
    """train.start.branch_from's tag dir, verified: the tag named, or a run dir's newest intact."""
    if "://" in spec:
        raise ConfigError(f"train.start.branch_from: {spec!r}: local paths only; copy the run dir "
                          "(or the tag) here first")
    path = Path(spec)
    if (path / "checkpoints").is_dir():
        tag = choose_tag(path / "checkpoints")
        if tag is None:
            raise ConfigError(f"train.start.branch_from: {path} has no checkpoint "
                              f"({path / 'checkpoints' / 'latest'} does not exist)")
        return path / "checkpoints" / tag
    if not (path.is_dir() and path.name.startswith(TAG_PREFIX)):
        raise ConfigError(f"train.start.branch_from: {spec!r} is neither a run dir (holding "
                          "checkpoints/) nor a checkpoint tag "
                          "(runs/<name>/checkpoints/step-NNNNNNN)")
    status = verify_tag(path)
    if not status.intact:
        raise InputError(f"train.start.branch_from: checkpoint {path}: {status.problem}")
    return path


def _link_tag(source: Path, root: Path) -> None:
    """source's files into root/<its name>, hard-linked where the file system allows (a tag's
    files are never written again), else copied, through a .tmp- dir renamed at the end."""
    tmp = root / f"{TMP_PREFIX}{source.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    names = tag_files(source) + ([MANIFEST_NAME] if (source / MANIFEST_NAME).is_file() else [])
    for name in names:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, tmp / name)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(source / name, tmp / name)
    os.replace(tmp, root / source.name)
    atomic_write_text(root / "latest", source.name)


Resumed = tuple[Optional[str], Optional[dict]]  # the tag (None: start fresh), the config it saved


def _branch(branch_from: str, current: dict, run_dir: Path, remote: bool) -> Resumed:
    """train.start.branch_from: the source tag compared, then linked into this run."""
    if remote:
        raise ConfigError("train.start.branch_from: not supported with a remote output_dir; branch "
                          "into a local run dir")
    source = branch_source(branch_from)
    saved = read_saved_config(source / CONFIG_NAME) if (source / CONFIG_NAME).is_file() else None
    changes = refused_changes(saved, current) if saved is not None else []
    if changes:
        raise ConfigError(
            f"train.start.branch_from: {source} is a checkpoint of another model or data stream: "
            f"{'; '.join(changes)}. A branch continues the same model and token stream "
            "(train.start.init_from starts a new run from an export's weights alone)")
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _link_tag(source, root)
    print(f"train.start.branch_from: starting from {source} (weights, optimizer state, step, data "
          "position and RNG; the LR schedule is this run's)", flush=True)
    return source.name, saved


def _decide(start: StartConfig, current: dict, run_dir: Path, remote: bool) -> Resumed:
    mode = start.resume
    root = checkpoint_dir(run_dir)
    branch = start.branch_from
    if mode == "never":
        if remote:
            raise ConfigError("train.start.resume: never is not supported with a remote output_dir "
                              "(its checkpoints would be overwritten); give this run another name")
        aside = _move_previous_run(run_dir)
        if aside is not None:
            print(f"train.start.resume=never: moved the previous run's files to {aside}; starting "
                  + ("over from train.start.branch_from" if branch else "fresh"), flush=True)
        return _branch(branch, current, run_dir, remote) if branch else (None, None)
    for path in remove_partial_saves(run_dir):
        print(f"removed {path}: a save that did not finish", flush=True)
    tag = chosen_tag(start.resume_from, run_dir, remote) if start.resume_from else choose_tag(root)
    if tag is None and branch:
        return _branch(branch, current, run_dir, remote)  # compared with the source's config there
    if tag is None:
        if mode == "require":
            raise ConfigError(f"train.start.resume: require, but {run_dir} has no checkpoint to "
                              f"resume ({root / 'latest'} does not exist)")
        return None, None
    if branch:
        print(f"train.start.branch_from ignored: resuming this run's checkpoint {tag}", flush=True)
    recorded = root / tag / CONFIG_NAME
    if not recorded.is_file():
        _warn(f"checkpoint {tag} has no recorded {CONFIG_NAME}: its config is not compared")
        return tag, None
    saved = read_saved_config(recorded)
    changes = refused_changes(saved, current)
    if changes:
        raise ConfigError(
            f"{run_dir} holds checkpoint {tag} of another model or data stream: "
            f"{'; '.join(changes)}. Give this run another name, or set train.start.resume=never to "
            "move the old checkpoints aside and start fresh")
    return tag, saved


def plan_resume(start: StartConfig, current: dict, run_dir: str | Path, remote: bool = False
                ) -> Resumed:
    """The checkpoint tag every rank resumes from (None: start fresh) and the config it saved
    (None: none recorded), read once, on rank 0; `current` is this run's config (config_to_dict),
    compared with the tag's. All ranks call this."""
    decision: list[Any] = [(None, None), None]  # ((tag, saved config), error)
    if is_rank0():
        try:
            decision[0] = _decide(start, current, Path(run_dir), remote)
        except (ConfigError, InputError) as err:
            decision[1] = err
    if dist.is_initialized():
        dist.broadcast_object_list(decision, src=0)
    if decision[1] is not None:
        raise decision[1]
    return decision[0]
