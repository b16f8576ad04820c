"""Transformer building blocks: RMSNorm, RoPE, causal attention (SDPA; documents.py for the
document mask; grouped-query under model.n_kv_heads), SwiGLU, and one `Block`.

The residual form is a switch of `Block` (config `residual`):
  preln     h + G(LN(h))                  (GPT-2 style init)
  deepnorm  LN(alpha*h + G(h))            DeepNet constants for N layers
  deeploop  LN(alpha*h + G(h))            DeepLoop constants, N counts every loop visit
where G is attention then SwiGLU (two sub-layers per block, each with its own residual).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig, RopeScaling
from .documents import AttnMask, attend
from .kv_cache import causal_mask
from .transitions import Transition, transition_for


def residual_constants(transition: Transition) -> tuple[float, float]:
    """(alpha, beta) for transition.cfg's residual form at N = transition.residual_unrolled_depth:
    alpha scales the residual stream in the Post-LN sum, beta is the xavier gain of the FFN, value
    and output projections; preln (1, 1). deeploop takes DeepNorm's when no block is revisited."""
    n, residual = transition.residual_unrolled_depth, transition.cfg.residual
    if residual == "preln":
        return 1.0, 1.0
    if residual == "deeploop" and transition.revisits_blocks:
        return (2 * n) ** 0.5, (8 * n) ** -0.5
    return (2 * n) ** 0.25, (8 * n) ** -0.25


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 runs do not lose the mean-square accumulation.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


# (cos, sin), fp32: (S, head_dim/2) for positions 0..S-1, or (B, 1, S, head_dim/2) per sequence
RopeTables = tuple[torch.Tensor, torch.Tensor]


def rope_tables(seq_len: int, cfg: ModelConfig, device: torch.device,
                position_ids: Optional[torch.Tensor] = None) -> RopeTables:
    """RoPE's cos/sin for positions 0..seq_len-1, or for `position_ids` (B, S) when given: made
    per forward in fp32, not stored as buffers, so casting the model to bf16 never degrades them."""
    inv_freq = _inv_freq(cfg.resolved_head_dim // 2, cfg.rope_theta, torch.device(device),
                         cfg.rope_scaling)
    if position_ids is not None:  # per sequence (left padding), broadcast over heads
        angles = (position_ids.to(device, torch.float32)[..., None] * inv_freq)[:, None]
        return angles.cos(), angles.sin()
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


@functools.lru_cache(maxsize=None)
def _inv_freq(half: int, theta: float, device: torch.device,
              scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """RoPE's frequencies, cached per size and device (generation calls rope_tables per token);
    made outside inference mode so the cached tensor can join autograd later. Read only."""
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = theta ** (-torch.arange(0, half, device=device, dtype=torch.float32) / half)
        return inv_freq if scaling is None else _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, r: RopeScaling) -> torch.Tensor:
    """Llama 3's frequencies (transformers' `_compute_llama3_parameters`, step for step): long
    wavelengths divided by the factor, short ones kept, those between interpolated."""
    low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = ((r.original_max_position_embeddings / wavelen - r.low_freq_factor)
              / (r.high_freq_factor - r.low_freq_factor))
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 1/0 key padding mask -> (B, 1, S, S) bool (kv_cache.causal_mask with no cache)."""
    return causal_mask(attention_mask.bool(), attention_mask.shape[-1])


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate (B, H, S, head_dim) by position, pairing dims (i, i + head_dim/2), in fp32."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class KVHook(Protocol):
    """`update` receives a call's (B, H_kv, S, head_dim) k and v after RoPE (H_kv: n_kv_heads)
    and returns those its attention reads (a KV cache; adaptive depth's exited tokens' latest
    K/V)."""

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # model.branch_scale=forward: beta on the values and the output (set by Block; None: off)
        self.scale: Optional[float] = None
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.resolved_n_kv_heads
        self.head_dim = head_dim = cfg.resolved_head_dim
        # the rows of qkv: q (n_heads heads), then k and v (n_kv_heads heads each)
        self.widths = (cfg.n_heads * head_dim, self.n_kv_heads * head_dim,
                       self.n_kv_heads * head_dim)
        self.qkv = nn.Linear(cfg.d_model, sum(self.widths), bias=False)
        self.proj = nn.Linear(self.widths[0], cfg.d_model, bias=False)
        # model.qk_norm: per-head RMSNorm of q and k before RoPE (not in the state dict when off)
        self.q_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: RopeTables,
                mask: Optional[AttnMask] = None, kv: Optional[KVHook] = None) -> torch.Tensor:
        """mask: None (plain causal, the training path), attention_mask_4d's (B, 1, S, S), or a
        document mask (documents.document_mask: SDPA's bool mask or a FlexMask).
        kv: a KVHook whose update(k, v) gives the keys/values attended to (after RoPE)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.widths, dim=-1)
        if self.scale is not None:
            v = v * self.scale
        q, k, v = (t.view(b, s, t.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)
                   for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:  # both, under model.qk_norm
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv is not None:
            k, v = kv.update(k, v)
        y = attend(q, k, v, mask)
        out = self.proj(y.transpose(1, 2).reshape(b, s, self.widths[0]))
        return out if self.scale is None else out * self.scale


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.resolved_ffn_hidden
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)
        self.scale: Optional[float] = None  # model.branch_scale=forward: beta on every matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        s = self.scale  # gate, up and down each act as the matrix beta * W
        return self.down(F.silu(self.gate(x) * s) * (self.up(x) * s)) * s


class Block(nn.Module):
    """Attention + SwiGLU with the residual form chosen by cfg.residual.

    `checkpointed` (activation_checkpointing=block) recomputes the block in backward, non-reentrant:
    reentrant breaks ZeRO-2/3 and DDP when a module runs several times per step. `transition`: the
    model's (its unrolled depth sets the residual constants and the init; default: from cfg).
    """

    def __init__(self, cfg: ModelConfig, checkpointed: bool = False,
                 transition: Optional[Transition] = None) -> None:
        super().__init__()
        self.cfg = cfg
        transition = transition or transition_for(cfg)
        self.post_ln = cfg.residual != "preln"
        self.alpha, self.beta = residual_constants(transition)
        self.checkpointed = checkpointed
        self.attn = CausalSelfAttention(cfg)
        self.mlp = SwiGLU(cfg)
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        # model.branch_scale=forward, or auto under Post-LN: beta leaves the init
        self.forward_scale = self.post_ln and cfg.branch_scale in ("forward", "auto")
        if self.forward_scale:
            self.attn.scale = self.mlp.scale = self.beta
        self._init_weights(cfg, transition.residual_unrolled_depth)

    @torch.no_grad()
    def _init_weights(self, cfg: ModelConfig, unrolled_depth: int) -> None:
        if self.post_ln:
            # DeepNet: xavier_normal with gain beta on FFN, value and output projections, gain 1
            # on query and key (they only set attention logits, not the residual scale). Under
            # branch_scale=forward gain 1, the same draws, and beta in the forward.
            gain = 1.0 if self.forward_scale else self.beta
            q, k, v = self.attn.qkv.weight.split(self.attn.widths, dim=0)
            nn.init.xavier_normal_(q)
            nn.init.xavier_normal_(k)
            for w in (v, self.attn.proj.weight, self.mlp.gate.weight, self.mlp.up.weight,
                      self.mlp.down.weight):
                nn.init.xavier_normal_(w, gain=gain)
            return
        # GPT-2: normal(init_std), output projections shrunk by sqrt(2N) so the residual stream's
        # variance does not grow with depth.
        out_std = cfg.init_std / math.sqrt(2 * unrolled_depth)
        for lin in (self.attn.qkv, self.mlp.gate, self.mlp.up):
            nn.init.normal_(lin.weight, std=cfg.init_std)
        for lin in (self.attn.proj, self.mlp.down):
            nn.init.normal_(lin.weight, std=out_std)

    def _forward(self, h: torch.Tensor, rope: RopeTables,
                 mask: Optional[AttnMask] = None, kv: Optional[KVHook] = None) -> torch.Tensor:
        if self.post_ln:
            h = self.norm1(self.alpha * h + self.attn(h, rope, mask, kv))
            return self.norm2(self.alpha * h + self.mlp(h))
        h = h + self.attn(self.norm1(h), rope, mask, kv)
        return h + self.mlp(self.norm2(h))

    def compile_math(self, backend: str) -> None:
        """Regional torch.compile of the block's math (train.engine.compile): `_forward` runs
        inside activation checkpointing and the module hooks, so neither is traced, and one graph
        serves every block, loop step and depth."""
        # this instance's compiled forward shadows the method, on purpose
        self._forward = torch.compile(self._forward, backend=backend)  # type: ignore[method-assign]

    def forward(self, h: torch.Tensor, rope: Optional[RopeTables] = None,
                mask: Optional[AttnMask] = None, kv: Optional[KVHook] = None) -> torch.Tensor:
        """kv: see KVHook (None: the training path)."""
        rope = rope_tables(h.shape[-2], self.cfg, h.device) if rope is None else rope
        # The mask and kv are passed only when set, so the default path calls _forward as before.
        args: tuple[Any, ...] = (h, rope) if mask is None else (h, rope, mask)
        if kv is not None:
            args = (h, rope, mask, kv)
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)
