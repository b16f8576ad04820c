"""A run's callbacks: train.callbacks' entries (the built-ins and the user's, each
`package.module:Class`) and train()'s, in hook order, and their states in a checkpoint. A bad
entry is one ConfigError line (exit status 2) before training starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from scse_dist.config import RunConfig
from scse_dist.train.callbacks.base import Callback
from scse_dist.train.config import BUILT_INS, CallbackSpec
from scse_dist.typed_yaml import ConfigError, build_dataclass

# The run config's sections (model, data, train, eval, ...). A callback's constructor and its
# Config's check get, by name, the sections their parameters are called after:
# `__init__(self, config, train)` is given the train section.
SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig)
                 if f.default_factory is not dataclasses.MISSING)


def configured_callbacks(cfg: RunConfig) -> list[Callback]:
    """One callback per enabled train.callbacks entry, in the mapping's order, each built with
    its Config and the sections its constructor names (as configured: the values train() resolves
    at start, such as an auto micro-batch, are state.cfg's)."""
    return [_instantiate(spec, cls, config, _sections(cls, cfg))
            for spec, cls, config in check_callbacks(cfg)]


def check_callbacks(cfg: RunConfig) -> list[tuple[CallbackSpec, type[Callback], Any]]:
    """Each enabled entry's class imported and its init_args checked into its Config (None
    without one), against the run too, nothing built yet: a bad entry is a ConfigError naming it.
    Yours are checked first, then those with init_args: a bad one is named before the built-ins
    without settings import torch. A Config's `check` gets the sections it names."""
    entries = [(name, spec) for name, spec in cfg.train.callbacks.items() if spec.enabled]
    resolved = {}
    for name, spec in sorted(entries, key=lambda e: (e[1].class_path.startswith(BUILT_INS),
                                                     not e[1].init_args)):
        where = f"train.callbacks.{name}"
        resolved[name] = _resolve(spec, where)
        check = getattr(resolved[name][1], "check", None)
        if check is None:
            continue
        try:
            check(**_sections(check, cfg))
        except ConfigError as exc:  # "init_args.<field>: ..." or about the entry as a whole
            sep = "." if str(exc).startswith("init_args.") else ": "
            raise ConfigError(f"{where}{sep}{exc}") from None
    return [(spec, *resolved[name]) for name, spec in entries]


def config_of(callbacks: dict[str, CallbackSpec], name: str) -> Any:
    """Entry `name`'s Config, its own fields checked (None: the entry is off or absent); its
    check against the run is check_callbacks'."""
    spec = callbacks.get(name)
    return _resolve(spec, f"train.callbacks.{name}")[1] if spec and spec.enabled else None


def _resolve(spec: CallbackSpec, where: str) -> tuple[type[Callback], Any]:
    cls = _import_class(spec.class_path, f"{where}.class_path")
    if cls.Config is not None:
        return cls, _own_config(cls.Config, spec, f"{where}.init_args")
    if spec.init_args:
        raise ConfigError(f"{where}.init_args: {spec.class_path} declares no Config dataclass, "
                          f"so it takes none; got {', '.join(sorted(spec.init_args))}")
    return cls, None


def _sections(function: Callable[..., Any], run: RunConfig) -> dict[str, Any]:
    """The sections of `run` that `function`'s parameters name."""
    names = inspect.signature(function).parameters
    return {name: getattr(run, name) for name in SECTIONS if name in names}


def _instantiate(spec: CallbackSpec, cls: type[Callback], config: Any,
                 sections: dict[str, Any]) -> Callback:
    callback = cls(**sections) if config is None else cls(config, **sections)  # type: ignore[call-arg]
    if spec.priority is not None:
        callback.priority = spec.priority
    return callback


def _import_class(path: str, where: str) -> type[Callback]:
    module_name, _, names = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: {path!r}: cannot import {module_name} ({exc})") from None
    for name in names.split("."):
        if not hasattr(found, name):
            raise ConfigError(f"{where}: {path!r}: {module_name} has no {names}")
        found = getattr(found, name)
    if not (isinstance(found, type) and issubclass(found, Callback)):
        raise ConfigError(f"{where}: {path!r} is not a subclass of "
                          "scse_dist.train.callbacks.Callback")
    return found


def _own_config(config_cls: type, spec: CallbackSpec, where: str) -> Any:
    missing = [f.name for f in dataclasses.fields(config_cls)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in spec.init_args]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: required by {spec.class_path}, missing")
    try:
        return build_dataclass(config_cls, spec.init_args, where)
    except ConfigError as exc:  # its own checks (__post_init__) name a field of init_args
        raise ConfigError(str(exc) if str(exc).startswith(where) else f"{where}.{exc}") from None


def in_hook_order(callbacks: Iterable[Callback]) -> list[Callback]:
    """Highest priority first; equal priorities keep the order given."""
    return sorted(callbacks, key=lambda callback: -callback.priority)


def state_keys(callbacks: Sequence[Callback]) -> list[str]:
    """Each callback's key in a checkpoint: its state_key, a repeat numbered (`key#2`, ...)."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    for callback in callbacks:
        key = callback.state_key
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    return keys


def callback_states(callbacks: Sequence[Callback]) -> dict[str, dict[str, Any]]:
    """What a checkpoint saves: {key: state_dict()} of the callbacks that have a state."""
    states = {key: callback.state_dict() for key, callback in zip(state_keys(callbacks), callbacks)}
    return {key: state for key, state in states.items() if state}


def restore_states(callbacks: Sequence[Callback], saved: dict[str, dict[str, Any]]) -> list[str]:
    """load_state_dict of each callback whose key `saved` holds; returns the keys of `saved`
    that no callback of this run took (a callback the resumed run no longer has)."""
    keys = state_keys(callbacks)
    for key, callback in zip(keys, callbacks):
        if key in saved:
            callback.load_state_dict(saved[key])
    return sorted(set(saved) - set(keys))
