"""The model's config: `ModelConfig` and the checks of its fields (a leaf: it imports nothing).

What depends on the recurrence lives on its `Transition` (transitions.py), as does
`check_model_config`, the full check. The checks raise a plain ValueError (the model imports
nothing of the config layer); `scse_dist.config.check_model` makes it a ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

# A field's bounds, declared in its metadata (`field(default=2, metadata={"gt": 0})`), with
# "finite": True where inf is out too and a "note" for the message: each bound's sign and test.
BOUNDS = {"gt": (">", operator.gt), "ge": (">=", operator.ge), "lt": ("<", operator.lt),
          "le": ("<=", operator.le)}


def bound_problem(f: dataclasses.Field, value: Any) -> Optional[str]:
    """'must be > 0, got 0' where a number lies outside the bounds its field declares in its
    metadata (BOUNDS), else None. The loader (typed_yaml) checks every section's fields by it,
    check_model_fields the model's (also an export's config.json)."""
    limits = [(kind, f.metadata[kind]) for kind in BOUNDS if kind in f.metadata]
    if not limits or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    finite, note = f.metadata.get("finite", False), f.metadata.get("note")
    got = f" ({note}), got {value}" if note else f", got {value}"
    # NaN fails every comparison
    if all(BOUNDS[kind][1](value, limit) for kind, limit in limits) and \
            not (finite and math.isinf(value)):
        return None
    if len(limits) == 2:  # an interval: [0, 1), (0, 1], ...
        (low, a), (high, b) = limits
        return f"must lie in {'(['[low == 'ge']}{a}, {b}{')]'[high == 'le']}{got}"
    ((kind, limit),) = limits
    return f"must be {'a finite number ' if finite else ''}{BOUNDS[kind][0]} {limit}{got}"


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (transformers' rope type `llama3`): wavelengths longer
    than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
    shorter than original_max_position_embeddings / high_freq_factor kept, and those between
    interpolated."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ModelConfig:
    vocab_size: int = field(default=4096, metadata={"gt": 0})
    d_model: int = field(default=256, metadata={"gt": 0})
    n_heads: int = field(default=4, metadata={"gt": 0})
    # Grouped-query attention: heads of keys and values, each shared by n_heads / n_kv_heads
    # query heads; None: n_heads (multi-head attention).
    n_kv_heads: Optional[int] = None
    # Width of each attention head; None: d_model / n_heads. Set, q is n_heads * head_dim wide,
    # k and v n_kv_heads * head_dim (Qwen3's need not equal d_model / n_heads).
    head_dim: Optional[int] = None
    # SwiGLU hidden width; 0 picks the usual 8/3 * d_model rounded up to a multiple of 64.
    ffn_hidden: int = field(default=0, metadata={"ge": 0})
    max_seq_len: int = field(default=256, metadata={"gt": 0})
    n_prelude: int = field(default=1, metadata={"ge": 0})
    n_core: int = field(default=1, metadata={"gt": 0})
    n_coda: int = field(default=1, metadata={"ge": 0})
    # A name in transitions.TRANSITIONS: untied, looped, additive, scse (or one registered there).
    recurrence: str = "scse"
    # `untied` only: match the looped model's unrolled depth or its parameter count (no loop).
    untied_match: Literal["depth", "params"] = "depth"
    residual: Literal["preln", "deepnorm", "deeploop"] = "deeploop"
    # How the source re-enters each step. "default": none for scse/looped, add for additive.
    inject: Literal["default", "none", "add", "concat"] = "default"
    anchor: Literal["learned", "source", "zero"] = "learned"
    init_state: Literal["source", "zeros", "random"] = "source"
    zero_mask: bool = True
    forcing_bias_scale: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    # Interventions against SCSE's loop collapse (docs/loop-diagnostics.md), off by default.
    # core_norm: h* = RMSNorm_core(a(s)), through the core's output norm, so the anchor's norm
    # tracks the core's output scale. auto: core_norm where it applies (scse, Post-LN, the learned
    # anchor), else free.
    anchor_scale: Literal["auto", "free", "core_norm"] = "free"
    # Weight of a loss term that keeps the loop moving (recurrence.stability_penalty).
    loop_stability: float = field(default=0.0, metadata={"ge": 0})
    # The T in the unrolled depth N of the residual constants and init; 0: `depth`.
    residual_depth: int = field(default=0, metadata={"ge": 0, "note": "0: model.depth"})
    # Where deepnorm/deeploop's beta acts: init, the xavier gain of the value, output and FFN
    # matrices (DeepNet); forward, those at gain 1 and their outputs multiplied by beta. auto:
    # forward under a Post-LN residual, init under preln (no beta).
    branch_scale: Literal["init", "forward", "auto"] = "init"
    # Nominal loop depth T: the default forward depth and the mean of sampled training depth.
    depth: int = field(default=4, metadata={"gt": 0})
    # auto: the trainer picks none or loop from its memory estimate; the model reads it as none.
    activation_checkpointing: Literal["none", "loop", "block", "auto"] = "none"
    tie_embeddings: bool = True
    # RMSNorm on each head's queries and keys before RoPE (OLMo 2, Qwen3): bounds the logits.
    qk_norm: bool = False
    # Attention within each packed document (documents.py); off: causal over the whole window.
    document_mask: bool = False
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama 3's RoPE scaling (RopeScaling); None: plain RoPE.
    rope_scaling: Optional[RopeScaling] = None
    init_std: float = 0.02

    def __post_init__(self) -> None:
        # a mapping (the Hugging Face config.json of an export) becomes the dataclass
        if isinstance(self.rope_scaling, dict):
            try:
                self.rope_scaling = RopeScaling(**self.rope_scaling)
            except TypeError as exc:
                raise ValueError(f"model.rope_scaling: {exc}") from None

    @property
    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return ((8 * self.d_model // 3) + 63) // 64 * 64

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim


def check_model_fields(m: ModelConfig) -> None:
    """Field values and combinations that no recurrence can run (transitions.check_model_config
    runs the recurrence's own after these)."""
    for f in dataclasses.fields(m):  # the loader checked these already; an export's config not
        problem = bound_problem(f, getattr(m, f.name))
        if problem:
            raise ValueError(f"model.{f.name}: {problem}")
    if m.head_dim is None and (m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2):
        raise ValueError(f"model.n_heads: d_model={m.d_model} must split into {m.n_heads} heads "
                          "of even width (RoPE rotates pairs), or set model.head_dim")
    if m.head_dim is not None and (m.head_dim <= 0 or m.head_dim % 2):
        raise ValueError(f"model.head_dim: must be even and > 0 (RoPE rotates pairs), got "
                          f"{m.head_dim}")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ValueError(f"model.n_kv_heads: must be > 0 and divide model.n_heads="
                          f"{m.n_heads}, got {m.n_kv_heads}")
    if m.branch_scale == "forward" and m.residual == "preln":
        raise ValueError("model.branch_scale: forward moves deepnorm/deeploop's beta into the "
                          "forward; residual=preln has no beta (use init, or a Post-LN residual)")
    r = m.rope_scaling
    if r is not None and not (r.factor >= 1 and 0 < r.low_freq_factor < r.high_freq_factor
                              and r.original_max_position_embeddings > 0):
        raise ValueError(f"model.rope_scaling: needs factor >= 1, 0 < low_freq_factor < "
                          f"high_freq_factor and original_max_position_embeddings > 0, got {r}")


# A model config saved before a field existed ran with that field's default of then, not today's
# (scse_dist.config.load_saved_config and the HF config read this).
VALUE_BEFORE_FIELD = {"anchor_scale": "free", "qk_norm": False, "document_mask": False,
                      "n_kv_heads": None, "head_dim": None}
