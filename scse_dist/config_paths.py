"""The input paths a run config names: where a relative one resolves, and the check that each one
exists (docs/config.md, "Paths in config files"). Torch-free: scse-train, scse-launch and
scse-study run the check before anything imports torch or queues a job.

A relative input path written in a config file (or a study spec) resolves against that file's
directory (like `base:`); one given on the command line against the working directory. A path
found only under the working directory is still read from there, with a notice. Output
locations (output_dir, tensorboard.log_dir) and the files data.build writes (data.path,
data.tokenizer when it is set) resolve against the working directory.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

# The run config's input fields: one path each, a list of paths, or a mapping of name -> path.
INPUT_FIELDS = ("data.path", "data.tokenizer", "data.mixture_paths",
                "train.engine.deepspeed_config", "train.start.init_from", "train.start.branch_from",
                "eval.task_settings")
TASK_SETTINGS = "eval.task_settings"  # task -> its settings: the path is each one's `path`
# what to do about a missing one, where there is more to say than "check the path"
ADVICE = {"data.path": "build its shards with `scse-data shards` (docs/data.md), or set "
                       "data.build=stdlib_docs for the quickstart corpus",
          "data.tokenizer": "train one with `scse-data tokenizer` (docs/data.md)"}
BUILT_FIELDS = ("data.path", "data.tokenizer")  # where data.build writes, when it is set
# a path resolved against a config file's directory -> (the path as written, that directory)
_WRITTEN: dict[str, tuple[str, str]] = {}
_noticed: set[tuple[str, str]] = set()


def field_value(values: Any, dotted: str) -> Any:
    """`dotted` ("eval.task_settings.toy.path") through mappings and dataclasses; None where a
    part is missing."""
    for part in dotted.split("."):
        values = values.get(part) if isinstance(values, dict) else getattr(values, part, None)
    return values


def _leaves(field: str, value: Any) -> Iterable[tuple[str, Any]]:
    """(name, path) of each path a field holds: data.mixture_paths[1],
    eval.task_settings.toy.path."""
    if field == TASK_SETTINGS:
        return ((f"{field}.{task}.path", field_value(own, "path")) for task, own in value.items()) \
            if isinstance(value, dict) else ()
    if isinstance(value, list):
        return ((f"{field}[{i}]", v) for i, v in enumerate(value))
    if isinstance(value, dict):
        return ((f"{field}.{k}", v) for k, v in value.items())
    return ((field, value),)


def _local(path: Any) -> bool:
    return isinstance(path, str) and bool(path.strip()) and "://" not in path


def input_exists(path: str) -> bool:
    """Whether a path, or the directory of a pattern of shards ({000..009}, *), exists."""
    cut = min((i for i in (path.find("{"), path.find("*")) if i >= 0), default=-1)
    return os.path.exists(path if cut < 0 else os.path.dirname(path[:cut]) or ".") or \
        bool(glob.glob(path))


def note_origins(values: dict, path: Path, origins: dict[str, Path]) -> None:
    """Record `path` as the file that sets each input path `values` (one config file's own
    mapping) holds, unless a file read before it (one that overlays it) set that path."""
    for field in INPUT_FIELDS:
        value = field_value(values, field)
        if value is None or (field == TASK_SETTINGS) != isinstance(value, dict):
            continue  # unset, or a value the typed config will refuse
        for name, v in _leaves(field, value):  # the tasks' paths merge task by task
            if v is None:
                continue
            origins.setdefault(field if field == "data.mixture_paths" else name, path)


def forget_overridden(origins: dict[str, Path], keys: Iterable[str]) -> None:
    """Drop the origins of the fields `keys` (overrides' dotted keys) set: those resolve against
    the working directory."""
    for key in keys:
        for name in [n for n in origins if n == key or n.startswith(key + ".")
                     or key.startswith(n + ".")]:
            del origins[name]


def _resolve_one(name: str, written: str, config: Path) -> str:
    """A relative path written in `config`: against its directory, else (if only found there)
    against the working directory, with a notice."""
    base = os.path.abspath(config.parent)
    new = os.path.normpath(os.path.join(base, written))
    old = os.path.abspath(written)
    found_new, found_old = input_exists(new), input_exists(old)
    note = None
    if found_old and not found_new:
        note = (f"{name}: {written!r} is not found next to {config} but in the working directory; "
                f"read from {old} for now: write it relative to the config file's directory")
        new = old
    elif found_old and found_new and os.path.realpath(new) != os.path.realpath(old):
        note = (f"{name}: {written!r} in {config} is read relative to the config file: {new}, "
                f"not {old} in the working directory")
    if note and (name, written) not in _noticed:
        _noticed.add((name, written))
        print(f"config: notice: {note}", file=sys.stderr, flush=True)
    if new != old:
        _WRITTEN.setdefault(new, (written, base))
    return new


def resolve_paths(values: dict, origins: dict[str, Path]) -> None:
    """Each relative input path a config file wrote (origins: field -> file), resolved in place
    (absolute); what data.build writes and what the command line gave stay as they are."""
    building = bool(field_value(values, "data.build"))
    for field in INPUT_FIELDS:
        value = field_value(values, field)
        if building and field in BUILT_FIELDS:
            continue
        if isinstance(value, list) and field in origins:
            value[:] = [_resolve_one(n, v, origins[field]) if _local(v) and not os.path.isabs(v)
                        else v for n, v in _leaves(field, value)]
            continue
        for name, v in list(_leaves(field, value)):
            if name in origins and _local(v) and not os.path.isabs(v):
                *path, leaf = name.split(".")
                field_value(values, ".".join(path))[leaf] = _resolve_one(name, v, origins[name])


def comparable(field: str, value: Any) -> Any:
    """`value` of `field` as a location to compare: an input path made absolute against the working
    directory (a saved config holds it as resolved then: absolute, or relative to where the run
    started); any other value as it is."""
    if field not in INPUT_FIELDS:
        return value
    if isinstance(value, list):
        return [comparable(field, v) for v in value]
    return os.path.abspath(value) if _local(value) else value


# A study spec's own input paths (beside the run-config input fields its overrides set)
SPEC_INPUTS = ("evals.wikitext", "evals.lambada", "evals.data", "lr.validation", "validation.path")


def _resolved(name: str, value: Any, file: Path) -> Any:
    if isinstance(value, list):
        return [_resolved(f"{name}[{i}]", v, file) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _resolved(f"{name}.{k}", v, file) for k, v in value.items()}
    return _resolve_one(name, value, file) if _local(value) and not os.path.isabs(value) else value


def resolve_spec_paths(values: dict, file: Path) -> None:
    """One study spec file's relative input paths, against its directory, in place: its evals'
    files, lr.validation, validation.path, and the input fields of its overrides (data.path and
    data.tokenizer not where the same overrides set data.build: the build's output)."""
    for field in SPEC_INPUTS:
        section, leaf = field.split(".")
        node = values.get(section)
        if isinstance(node, dict) and leaf in node:
            node[leaf] = _resolved(field, node[leaf], file)
    variants = values.get("variants")
    mappings = [("overrides", values.get("overrides"))] + [
        (f"variants.{name}.overrides", v.get("overrides"))
        for name, v in (variants.items() if isinstance(variants, dict) else ())
        if isinstance(v, dict)]
    for where, overrides in mappings:
        if not isinstance(overrides, dict):
            continue
        for key, value in overrides.items():
            built = overrides.get("data.build") and key in BUILT_FIELDS
            if (key in INPUT_FIELDS or key.startswith(TASK_SETTINGS + ".")) and not built:
                overrides[key] = _resolved(f"{where}.{key}", value, file)


def input_paths(cfg: Any) -> dict[str, str]:
    """name -> each local input path the run reads: what data.build writes, URLs, and
    init_from/branch_from of a run that resumes its own checkpoint (which ignores them) left out."""
    resumes = cfg.train.start.resume != "never" and \
        (Path(cfg.run_dir) / "checkpoints" / "latest").exists()
    found: dict[str, str] = {}
    for field in INPUT_FIELDS:
        if (cfg.data.build and field in BUILT_FIELDS) or (resumes and "start" in field):
            continue
        found.update((n, v) for n, v in _leaves(field, field_value(cfg, field)) if _local(v))
    return found


def missing_message(name: str, path: str) -> Optional[str]:
    """None if `path` exists; else the line: the field, the path as written, and what it was
    resolved against."""
    if input_exists(path):
        return None
    where: Optional[str]
    if path in _WRITTEN:
        written, base = _WRITTEN[path]
        where = f"{base}, the directory of the config file that names it"
    else:
        written, where = path, (None if os.path.isabs(path) else
                                f"{os.getcwd()}, the working directory")
    advice = ADVICE.get(name)
    return (f"{name}: {written!r} does not exist"
            + (f" (resolved against {where})" if where else "") + (f"; {advice}" if advice else ""))


def check_inputs(cfg: Any, fields: Optional[Iterable[str]] = None) -> None:
    """FileNotFoundError (exit 66), one line naming the field, for the first input path of `cfg`
    (of `fields` only, if given) that does not exist."""
    for name, path in input_paths(cfg).items():
        if fields is None or any(name == f or name.startswith(f + ".") or
                                 name.startswith(f + "[") for f in fields):
            message = missing_message(name, path)
            if message:
                raise FileNotFoundError(message)
