"""Training FLOPs per token over the unrolled depth, for MFU.

Counted (2 FLOPs per multiply-accumulate, forward; training = 3x forward for the backward's two
matmuls per forward matmul):
  per block        2 * (4 d^2 + 3 d f)     q, k, v, out projections and the SwiGLU's three matrices
                   + 2 * 2 * S * d         attention scores QK^T and the weighted sum AV. Causal
                                           attention is counted in full (not halved), as is
                                           conventional (PaLM / nanoGPT MFU), so MFU is comparable.
  blocks run       n_prelude + n_core * calls + n_coda, calls = Transition.core_calls(T): T + 1
                   for scse (r* = Phi(h*) once), T for looped/additive; untied runs its fixed
                   stack once (T must be its fixed depth).
  concat adapter   2 * 2d * d per core call;  learned anchor  2 * d^2 once (scse)
  LM head          2 * d * V
Norms (model.qk_norm's too), RoPE, softmax, the z-loss and elementwise ops are left out (they
are a few percent at most).
"""

from __future__ import annotations

from .config import ModelConfig
from .transitions import transition_for


def flops_per_token(cfg: ModelConfig, depth: int, seq_len: int) -> float:
    transition = transition_for(cfg)
    transition.check_depth(depth)  # untied: only its fixed depth
    calls = transition.core_calls(depth)
    d, f = cfg.d_model, cfg.resolved_ffn_hidden
    block = 2 * (4 * d * d + 3 * d * f) + 2 * 2 * seq_len * d
    forward: float = (cfg.n_prelude + cfg.n_core * calls + cfg.n_coda) * block \
        + 2 * d * cfg.vocab_size
    if transition.resolved_inject == "concat":
        forward += calls * 2 * (2 * d) * d
    forward += transition.own_flops()
    return 3.0 * forward
