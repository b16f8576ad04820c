"""Typed YAML: a dataclass built from a nested dict with every value checked against its field's
type and the bounds its metadata declares (model.config.bound_problem; one `ConfigError` naming the
field), `key.sub=value` overrides, YAML files that overlay a `base:` file, and the one notice that
an old name was read. Generic: the run config, study specs, callbacks' Configs and the commands'
flags use it."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml

from scse_dist.model.config import bound_problem


class ConfigError(ValueError):
    """A config field is unknown, mistyped or inconsistent. The message names the field."""

_noticed: set[str] = set()


def old_name_notice(old: str, new: str, who: str = "config") -> None:
    """Say on stderr, once per process, that old name `old` (a config field, a spec's key, a flag)
    was read as `new`."""
    line = f"{who}: notice: {old} is now {new}; the old name is read for now"
    if line not in _noticed:
        _noticed.add(line)
        print(line, file=sys.stderr, flush=True)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


_EXACT = {bool: "true or false", int: "an integer", str: "a string"}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if tp is Any:  # checked later by whoever reads it (train.callbacks' init_args: the callback)
        return value
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: may not be null")
    # e.g. int or "auto": the first that takes it
    if typing.get_origin(tp) in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return build_dataclass(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, choices))}; got "
                              f"{value!r}")
        return value
    if origin is dict:  # str -> value, e.g. eval.data
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        value_tp = typing.get_args(tp)[1]
        return {str(k): _coerce(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and item_tp is int:
            value = [value] if not isinstance(value, str) else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v if not isinstance(v, str) or item_tp is str else _parse_scalar(v),
                        item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp in _EXACT:  # bool, int (a bool is no int here) and str: taken as they are
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {_EXACT[tp]}, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    raise ConfigError(f"{where}: unsupported field type {tp}")  # pragma: no cover - schema bug


def _coerce_union(value: Any, members: tuple, where: str) -> Any:
    for member in members:
        try:
            return _coerce(value, member, where)
        except ConfigError:
            pass
    wanted = " or ".join("an integer" if m is int else "a number" if m is float else
                         ", ".join(map(repr, typing.get_args(m))) if typing.get_origin(m) is Literal
                         else getattr(m, "__name__", str(m)) for m in members)
    raise ConfigError(f"{where}: expected {wanted}, got {value!r}")


def build_dataclass(cls: type, values: dict, prefix: str = "") -> Any:
    """`cls` from `values`, each checked against its field's type and bounds (ConfigError naming
    it)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(fields)}"
            raise ConfigError(f"{where}: unknown field{hint}")
        kwargs[key] = _coerce(value, hints[key], where)
        problem = bound_problem(fields[key], kwargs[key])
        if problem:
            raise ConfigError(f"{where}: {problem}")
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _is_dotted(path: list[str], dotted: tuple[str, ...]) -> bool:
    """Whether the mapping at `path` is one of `dotted` (patterns like variants.*.overrides)."""
    return any(len(names) == len(path) and all(n in ("*", p) for n, p in zip(names, path))
               for names in (pattern.split(".") for pattern in dotted))


def apply_overrides(values: dict, overrides: list[str], dotted: tuple[str, ...] = ()) -> dict:
    """Apply `a.b.c=value` strings (value parsed as YAML) to a nested dict, in place. `dotted`:
    paths (`*` for any one name) of mappings whose keys are dotted paths themselves: an override
    into one takes the rest of its key as one key (`overrides.data.path=x`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node, i = values, 0
        while i < len(parts) - 1 and not _is_dotted(parts[:i], dotted):
            node = node.setdefault(parts[i], {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {parts[i]!r} is not a section")
            i += 1
        node[".".join(parts[i:])] = _parse_scalar(raw)
    return values


def deep_merge(base: dict, over: dict) -> dict:
    """A copy of `base` with `over` laid on top: nested dicts merge key by key, any other value
    of `over` replaces base's. Neither input is modified, nor shares anything with the result."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_one(path: Path, kind: str = "config file") -> dict:
    """One YAML file's own mapping (its `base:` not followed)."""
    if not path.is_file():
        raise ConfigError(f"{kind} {str(path)!r} " + ("is a directory, not a YAML file"
                          if path.is_dir() else "does not exist"))
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{kind} {str(path)!r} is not UTF-8 text (byte "
                          f"{exc.object[exc.start]:#04x} at offset {exc.start}); a config is a "
                          "YAML text file") from None
    except OSError as exc:
        raise ConfigError(f"{kind} {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"{kind} {where}: not valid YAML ({what})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{kind} {str(path)!r}: expected a mapping at the top level")
    return values


def setting_file(path: Path, key: str, overlay: str = "base") -> Path | None:
    """The file of `path`'s `base:` chain whose value of `key` (dotted) the config takes: the
    first, from `path` down, that sets it; None when none does."""
    values = _read_one(path)
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            base = values.get(overlay)
            return setting_file(path.parent / base, key, overlay) if isinstance(base, str) else None
        node = node[part]
    return path


def _read_yaml(path: Path, seen: tuple[Path, ...] = (), *, kind: str = "config file",
               overlay: str = "base", file_relative: tuple[str, ...] = (),
               normalize: Optional[Callable[[dict, Path], Any]] = None) -> dict:
    """Read a config file; `base: other.yaml` (relative to the file) is loaded first and overlaid.

    kind: what the file is, in messages. overlay: the key naming the file to overlay.
    file_relative: top-level keys holding paths relative to the file that set them.
    normalize: applied to each file's values (in place), with the file's path, before they are
    overlaid; the file that overlays another comes first."""
    if path.resolve() in seen:
        raise ConfigError(f"{kind} {str(path)!r}: `{overlay}` chain loops back to itself")
    values = _read_one(path, kind)
    base = values.pop(overlay, None)
    if normalize is not None:
        normalize(values, path)
    if base is None:
        return values
    if not isinstance(base, str):
        raise ConfigError(f"{overlay}: expected a file name, got {base!r} (in {path})")
    under = _read_yaml(path.parent / base, seen + (path.resolve(),), kind=kind, overlay=overlay,
                       file_relative=file_relative, normalize=normalize)
    for key in file_relative:
        if isinstance(under.get(key), str) and not os.path.isabs(under[key]):
            under[key] = os.path.relpath((path.parent / base).parent / under[key], path.parent)
    return deep_merge(under, values)
