"""The parameter groups of a LoopedLM by role: one classification, `group_of(name)`.

    embed      the token embedding (also the LM head when tied)
    head       an untied LM head
    prelude    the prelude blocks' attention and SwiGLU matrices
    anchor     SCSE's learned anchor map Q (h* = Q s)
    adapter    the concat injection's adapter W ([h; s] -> d)
    core_attn  the core blocks' attention matrices (qkv, proj), every block group (untied too)
    core_mlp   the core blocks' SwiGLU matrices (gate, up, down)
    coda       the coda blocks' attention and SwiGLU matrices
    norm       every RMSNorm gain: the blocks' norm1/norm2, qk_norm's q_norm/k_norm, the final norm

The gradient shares (diag/grad_share_*) use SHARE_GROUPS, where a parameter sits
(`share_group_of`). Norm gains are one group wherever they sit: an optimizer step moves them most
relative to their size. No torch: the config's check uses it.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable, Mapping

from scse_dist.typed_yaml import ConfigError

PARAM_GROUPS = ("embed", "head", "prelude", "anchor", "adapter", "core_attn", "core_mlp", "coda",
                "norm")

SHARE_GROUPS = ("anchor", "core", "prelude", "coda", "embed")  # share_group_of's
_SHARE_OF = {"head": "coda", "adapter": "core", "core_attn": "core", "core_mlp": "core"}

_NORM = re.compile(r"(^|\.)(norm1|norm2|q_norm|k_norm)\.weight$")
_BLOCK = re.compile(r"^(prelude|coda|core\.blocks)\.\d+\.(attn|mlp)\.")


def group_of(name: str) -> str:
    """The PARAM_GROUPS entry of a LoopedLM parameter name (`model.named_parameters()`); a name of
    no group raises ValueError naming it (a new parameter must be given a group here)."""
    if _NORM.search(name) or name == "norm.weight":
        return "norm"
    if name in ("embed.weight", "head.weight"):
        return name.split(".")[0]
    if name.startswith(("core.anchor.", "core.adapter.")):
        return name.split(".")[1]
    block = _BLOCK.match(name)
    if block is not None:
        part, sub = block.groups()
        return f"core_{sub}" if part == "core.blocks" else part
    raise ValueError(f"param_groups.group_of: parameter {name!r} is in no group of "
                     f"{', '.join(PARAM_GROUPS)}; add it to scse_dist/param_groups.py")


def share_group_of(name: str) -> str:
    """The SHARE_GROUPS entry of a parameter name: where its group_of sits (an untied head with the
    coda, the adapter in the core, a norm gain with its part, the final norm with the coda)."""
    group = group_of(name)
    if group == "norm":
        group = name.split(".", 1)[0] if name.startswith(("core.", "prelude.")) else "coda"
    return _SHARE_OF.get(group, group)


def check_lr_mult(lr_mult: Mapping[str, float]) -> None:
    """train.optimizer.lr_mult: keys that are groups, values finite and >= 0 (ConfigError, one
    line)."""
    for key, value in lr_mult.items():
        if key not in PARAM_GROUPS:
            close = difflib.get_close_matches(key, PARAM_GROUPS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"train.optimizer.lr_mult: unknown parameter group {key!r}; "
                              f"{hint}the groups are {', '.join(PARAM_GROUPS)}")
        if not 0 <= value < math.inf:  # also rejects NaN
            raise ConfigError(f"train.optimizer.lr_mult.{key}: must be a finite multiplier >= 0, "
                              f"got {value}")


def with_lr_mult(named: Iterable[tuple[str, Any]], groups: list[dict[str, Any]], lr: float,
                 lr_mult: Mapping[str, float], optimizer: str = "AdamW") -> list[dict[str, Any]]:
    """The optimizer's param groups, each split by the train.optimizer.lr_mult factor of its
    parameters' groups, lr = `lr` * factor, other settings copied. Factor-1 groups come first, so
    the log's `lr` (group 0's) stays train.optimizer.lr's. A named group with no parameter in
    `groups` is a ConfigError (`optimizer` says whose groups these are)."""
    if not lr_mult:
        return groups
    name_of = {id(p): name for name, p in named}
    found: set[str] = set()
    plain: list[dict[str, Any]] = []
    scaled: list[dict[str, Any]] = []
    for group in groups:
        by_factor: dict[float, list[Any]] = {}
        for p in group["params"]:
            g = group_of(name_of[id(p)])
            found.add(g)
            by_factor.setdefault(float(lr_mult.get(g, 1.0)), []).append(p)
        for factor, params in by_factor.items():
            (plain if factor == 1.0 else scaled).append(
                {**group, "params": params, "lr": lr * factor})
    for key in lr_mult:
        if key not in found:
            raise ConfigError(f"train.optimizer.lr_mult.{key}: no parameter that {optimizer} "
                              f"updates is in group {key} in this model (its groups there: "
                              f"{', '.join(g for g in PARAM_GROUPS if g in found)})")
    return plain + scaled


def lr_mult_split(lr_mult: Mapping[str, float]) -> frozenset[frozenset[str]]:
    """The partition of PARAM_GROUPS by lr_mult factor (how with_lr_mult splits): a resume may
    change the factors but not this (DeepSpeed loads optimizer state group by group)."""
    by_factor: dict[float, set[str]] = {}
    for g in PARAM_GROUPS:
        by_factor.setdefault(float(lr_mult.get(g, 1.0)), set()).add(g)
    return frozenset(frozenset(names) for names in by_factor.values())
