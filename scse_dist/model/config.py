"""The model's config: `ModelConfig` and the checks of its field combinations.

Part of the model package (which imports nothing else of scse_dist, so it can be copied verbatim
into an export as remote code); `scse_dist.config` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


class ConfigError(ValueError):
    """A config field is unknown, mistyped or inconsistent. The message names the field."""


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    # SwiGLU hidden width; 0 picks the usual 8/3 * d_model rounded up to a multiple of 64.
    ffn_hidden: int = 0
    max_seq_len: int = 256
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    recurrence: Literal["untied", "looped", "additive", "scse"] = "scse"
    # `untied` only: match the looped model's unrolled depth (n_prelude + n_core*depth + n_coda
    # distinct blocks) or its parameter count (n_prelude + n_core + n_coda blocks, no loop).
    untied_match: Literal["depth", "params"] = "depth"
    residual: Literal["preln", "deepnorm", "deeploop"] = "deeploop"
    # How the source re-enters each step. "default": none for scse/looped, add for additive.
    inject: Literal["default", "none", "add", "concat"] = "default"
    anchor: Literal["learned", "source", "zero"] = "learned"
    init_state: Literal["source", "zeros", "random"] = "source"
    zero_mask: bool = True
    forcing_bias_scale: float = 0.0
    # Nominal loop depth T: the default forward depth, the mean of sampled training depth, and
    # the T in the unrolled depth N that deepnorm/deeploop constants are computed from.
    depth: int = 4
    activation_checkpointing: Literal["none", "loop", "block"] = "none"
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02

    @property
    def transition(self):
        """The recurrence's Transition (scse_dist.model.transitions), made on each access."""
        from .transitions import transition_for  # it imports this module

        return transition_for(self)

    @property
    def resolved_inject(self) -> str:
        return self.inject if self.inject != "default" else self.transition.default_inject

    @property
    def resolved_ffn_hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return ((8 * self.d_model // 3) + 63) // 64 * 64

    @property
    def unrolled_depth(self) -> int:
        """N = n_prelude + n_core*T + n_coda at the nominal depth (every loop visit counts)."""
        steps = self.transition.fixed_depth or self.depth
        return self.n_prelude + self.n_core * steps + self.n_coda


def check_model_config(m: ModelConfig) -> None:
    """Combinations of model fields that cannot work. LoopedLM calls this too, so a ModelConfig
    built in code gets the same messages as one loaded from YAML."""
    for name in ("vocab_size", "d_model", "n_heads", "max_seq_len", "n_core", "depth"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}: must be > 0, got {getattr(m, name)}")
    for name in ("n_prelude", "n_coda", "ffn_hidden"):
        if getattr(m, name) < 0:
            raise ConfigError(f"model.{name}: must be >= 0, got {getattr(m, name)}")
    if m.d_model % m.n_heads or (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"model.n_heads: d_model={m.d_model} must split into {m.n_heads} heads "
                          "of even width (RoPE rotates pairs)")
    if not 0.0 <= m.forcing_bias_scale <= 1.0:
        raise ConfigError(f"model.forcing_bias_scale: must lie in [0, 1], got {m.forcing_bias_scale}")
    m.transition.check()
