"""The parameter groups of a LoopedLM by role: one classification, `group_of(name)`, shared by the
per-group diagnostics (update-to-weight ratios, docs/loop-diagnostics.md) and anything that treats
the roles differently.

    embed      the token embedding (also the LM head when tied)
    head       an untied LM head
    prelude    the prelude blocks' attention and SwiGLU matrices
    anchor     SCSE's learned anchor map Q (h* = Q s)
    adapter    the concat injection's adapter W ([h; s] -> d)
    core_attn  the core blocks' attention matrices (qkv, proj), every block group (untied too)
    core_mlp   the core blocks' SwiGLU matrices (gate, up, down)
    coda       the coda blocks' attention and SwiGLU matrices
    norm       every RMSNorm gain: the blocks' norm1/norm2, qk_norm's q_norm/k_norm, the final norm

Norm gains are one group wherever they sit: under Post-LN the core's last norm2 gain is the output
scale rho of Phi (diagnostics.core_scale), and gains are the parameters an optimizer step moves
most relative to their size. Imports nothing heavy: config checks may name the groups.
"""

from __future__ import annotations

import re

PARAM_GROUPS = ("embed", "head", "prelude", "anchor", "adapter", "core_attn", "core_mlp", "coda",
                "norm")

_NORM = re.compile(r"(^|\.)(norm1|norm2|q_norm|k_norm)\.weight$")
_BLOCK = re.compile(r"^(prelude|coda|core\.blocks)\.\d+\.(attn|mlp)\.")


def group_of(name: str) -> str:
    """The PARAM_GROUPS entry of a LoopedLM parameter name (`model.named_parameters()`); a name of
    no group raises ValueError naming it (a new parameter must be given a group here)."""
    if _NORM.search(name) or name == "norm.weight":
        return "norm"
    if name == "embed.weight":
        return "embed"
    if name == "head.weight":
        return "head"
    if name.startswith("core.anchor."):
        return "anchor"
    if name.startswith("core.adapter."):
        return "adapter"
    block = _BLOCK.match(name)
    if block is not None:
        part, sub = block.groups()
        return f"core_{sub}" if part == "core.blocks" else part
    raise ValueError(f"param_groups.group_of: parameter {name!r} is in no group of "
                     f"{', '.join(PARAM_GROUPS)}; add it to scse_dist/train/param_groups.py")
