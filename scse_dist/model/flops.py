"""Training FLOPs per token over the unrolled depth, for MFU.

Counted (2 FLOPs per multiply-accumulate, forward; training = 3x forward for the backward's two
matmuls per forward matmul):
  per block        2 * (d (2q + 2kv) + 3 d f)  q, k, v and out projections and the SwiGLU's
                                               three matrices; q = n_heads x head_dim, kv =
                                               n_kv_heads x head_dim (both d by default: 4 d^2)
                   + 2 * 2 * S * q             attention QK^T and AV, in full (as PaLM /
                                               nanoGPT), over every query head
  blocks run       n_prelude + n_core * calls + n_coda, calls = Transition.core_calls(T) (scse:
                   T + 1); untied runs its fixed stack once.
  concat adapter   2 * 2d * d per core call;  learned anchor  2 * d^2 once (scse)
  LM head          2 * d * V
  backprop_steps   with k > 0, the first T - k loop steps have no backward: their core calls
                   count 1x, not 3x.
Norms, RoPE, softmax, the z-loss and elementwise ops are left out (a few percent at most).
"""

from __future__ import annotations

from .config import ModelConfig
from .transitions import transition_for


def flops_per_token(cfg: ModelConfig, depth: int, seq_len: int, backprop_steps: int = 0) -> float:
    transition = transition_for(cfg)
    transition.check_depth(depth)  # untied: only its fixed depth
    calls = transition.core_calls(depth)
    d, f = cfg.d_model, cfg.resolved_ffn_hidden
    q, kv = cfg.n_heads * cfg.resolved_head_dim, cfg.resolved_n_kv_heads * cfg.resolved_head_dim
    block = 2 * (d * (2 * q + 2 * kv) + 3 * d * f) + 2 * 2 * seq_len * q
    per_call = cfg.n_core * block + (2 * (2 * d) * d if transition.resolved_inject == "concat"
                                     else 0)
    forward: float = (cfg.n_prelude + cfg.n_coda) * block + calls * per_call \
        + 2 * d * cfg.vocab_size + transition.own_flops()
    # the loop's steps before the last k (recurrence.py: frozen_steps) have no backward
    frozen = depth - backprop_steps if 0 < backprop_steps < depth else 0
    return 3.0 * forward - 2.0 * frozen * per_call
