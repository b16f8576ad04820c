"""The loop: one module, `LoopCore`, holding the shared core blocks, the anchor and the concat adapter.

It runs the whole recurrence in one `forward`, so the training side can register this class as a
DeepSpeed ZeRO-3 leaf module (`deepspeed.utils.set_z3_leaf_modules(model, [LoopCore])`): its
parameters are then gathered once per forward/backward whatever the depth. Its `forward` returns a
flat tuple of tensors: ZeRO-3 reduces a leaf's gradients in a full backward hook, which torch calls
only for Tensor or tuple outputs (checked with DeepSpeed 0.19.8: a dict output left the grads
unreduced and the optimizer step failed).

Transitions (cfg.recurrence), with Phi(h) = F(h), F(h + s) or F(W[h; s]) by cfg.inject:
  looped / additive   x_0 = H0,        x_{t+1} = Phi(x_t),                          h_t = x_t
  scse                x_0 = H0 - h*,   x_{t+1} = m(x_t) * (Phi(h* + x_t) - ref),    h_t = h* + x_t
                      with h* = anchor(s), r* = Phi(h*) once per forward,
                      ref = r* - lambda * (r* - h*) = h* + (1 - lambda) * b,  b = r* - h*
  untied              like looped, but step t runs its own distinct group of n_core blocks
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig, check_model_config
from .blocks import Block, RopeTables, rope_tables

Context = dict[str, torch.Tensor]
# Names of the diagnostics LoopCore.forward appends to its outputs, in order.
DIAGNOSTICS = ("deviation_norm", "motion_norm", "forcing_bias_norm")


def _row_norm_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the per-token L2 norm, in fp32."""
    return x.detach().float().norm(dim=-1).mean()


class LoopCore(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.kind = cfg.recurrence
        self.inject = cfg.resolved_inject
        self.anchor_kind = cfg.anchor
        self.init_state = cfg.init_state
        self.forcing_bias_scale = cfg.forcing_bias_scale
        self.zero_mask = cfg.zero_mask and self.kind == "scse"
        self.checkpoint_steps = cfg.activation_checkpointing == "loop"
        self.n_core = cfg.n_core
        self.cfg = cfg
        check_model_config(cfg)
        # untied is a plain stack: one distinct group of n_core blocks per "step".
        groups = 1
        if self.kind == "untied" and cfg.untied_match == "depth":
            groups = cfg.depth
        self.fixed_depth: Optional[int] = groups if self.kind == "untied" else None
        ckpt_blocks = cfg.activation_checkpointing == "block"
        self.blocks = nn.ModuleList(Block(cfg, checkpointed=ckpt_blocks)
                                    for _ in range(cfg.n_core * groups))
        self.anchor: Optional[nn.Linear] = None
        if self.kind == "scse" and self.anchor_kind == "learned":
            self.anchor = nn.Linear(d, d, bias=False)
            # Orthogonal init: h* = Q s keeps each token's norm, so the anchor sits as far from 0
            # as s does (RMSNorm's Jacobian scales like 1/sqrt(eps) at 0: a zero init blows up the
            # anchor's gradients), and D_0 = s - Q s is O(|s|) and not parallel to h*. Identity
            # would give D_0 = 0 (the mask freezes every token); a multiple c*I gives D_0 parallel
            # to h*, which the first Post-LN norm erases (measured: bf16 rows collapsed to D = 0).
            nn.init.orthogonal_(self.anchor.weight)
        self.adapter: Optional[nn.Linear] = None
        if self.inject == "concat":
            self.adapter = nn.Linear(2 * d, d, bias=False)
            # W = [I, I]: starts as the add injection (a small random W would shrink the state
            # toward RMSNorm's singular point); training then learns the mixing.
            with torch.no_grad():
                self.adapter.weight.copy_(torch.cat([torch.eye(d), torch.eye(d)], dim=1))

    # ------------------------------------------------------------------ pieces of one step

    def anchor_of(self, s: torch.Tensor) -> torch.Tensor:
        """h* for scse; the source s is the reference anchor of the other kinds (diagnostics)."""
        if self.kind != "scse" or self.anchor_kind == "source":
            return s
        if self.anchor_kind == "zero":
            return torch.zeros_like(s)
        return self.anchor(s)

    def phi(self, h: torch.Tensor, s: torch.Tensor, t: int = 0,
            rope: Optional[RopeTables] = None) -> torch.Tensor:
        """One core application Phi(h); `t` picks the block group (only untied has several)."""
        rope = rope_tables(h.shape[-2], self.cfg, h.device) if rope is None else rope
        if self.inject == "add":
            h = h + s
        elif self.inject == "concat":
            h = self.adapter(torch.cat([h, s], dim=-1))
        group = t if self.kind == "untied" else 0
        for block in self.blocks[group * self.n_core:(group + 1) * self.n_core]:
            h = block(h, rope)
        return h

    def initial_state(self, s: torch.Tensor) -> torch.Tensor:
        """H0 by cfg.init_state."""
        if self.init_state == "source":
            return s
        if self.init_state == "zeros":
            return torch.zeros_like(s)
        # random: scaled to the source's RMS so it is neither negligible nor dominant.
        return torch.randn_like(s) * s.detach().float().pow(2).mean().sqrt().to(s.dtype)

    def start(self, s: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
              rope: Optional[RopeTables] = None) -> tuple[torch.Tensor, Context]:
        """The loop variable x_0 and the per-forward context (source, anchor, RoPE's cos/sin,
        r*, ref)."""
        h0 = self.initial_state(s) if initial_state is None else initial_state
        anchor = self.anchor_of(s)
        cos, sin = rope_tables(s.shape[-2], self.cfg, s.device) if rope is None else rope
        ctx: Context = {"source": s, "anchor": anchor, "cos": cos, "sin": sin}
        if self.kind != "scse":
            return h0, ctx
        response = self.phi(anchor, s, rope=(cos, sin))  # r*: the one extra core call of SCSE
        ctx["response"] = response
        # lerp is exact at both ends: ref = r* for lambda 0 (so a zero row gives exactly 0 even
        # without the mask), ref = h* for lambda 1.
        ctx["ref"] = torch.lerp(response, anchor, self.forcing_bias_scale)
        return h0 - anchor, ctx

    def step(self, x: torch.Tensor, ctx: Context, t: int = 0) -> torch.Tensor:
        """x_t -> x_{t+1} (x is the deviation D for scse, the state h otherwise)."""
        rope = ctx["cos"], ctx["sin"]
        if self.kind != "scse":
            return self.phi(x, ctx["source"], t, rope)
        delta = self.phi(ctx["anchor"] + x, ctx["source"], t, rope) - ctx["ref"]
        if self.zero_mask:
            # Attention mixes rows: without this a row sitting exactly at its anchor would be
            # moved by its neighbours. With it the anchor invariance is exact, bit for bit
            # (0 * finite = +-0). A multiply, not masked_fill: one op fewer each way (~2% step).
            delta = delta * (x != 0).any(dim=-1, keepdim=True).to(delta.dtype)
        return delta

    def state(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h_t from the loop variable."""
        return ctx["anchor"] + x if self.kind == "scse" else x

    # ------------------------------------------------------------------ the whole loop

    def core_calls(self, depth: int) -> int:
        """Phi applications of a forward to `depth`: r* once more for scse."""
        return depth + 1 if self.kind == "scse" else depth

    def forward(self, s: torch.Tensor, depth: int, readout_depths: Optional[Iterable[int]] = None,
                backprop_steps: int = 0, initial_state: Optional[torch.Tensor] = None,
                diagnostics: bool = False, rope: Optional[RopeTables] = None
                ) -> tuple[torch.Tensor, ...]:
        """Run `depth` steps once. Returns a flat tuple: h_t for t in sorted(readout_depths)
        (default (depth,)), then, if diagnostics, the DIAGNOSTICS tensors in that order.

        A tuple of tensors, not a dict: as a ZeRO-3 leaf this module's gradients are reduced in a
        full backward hook, which torch only calls for Tensor or tuple outputs.
        backprop_steps=k in (0, depth): the first depth-k steps run without grad and the state is
        detached before the last k (the anchor and r* keep their grad).
        rope: RoPE's cos/sin from the model's forward (made here when not given).
        """
        if backprop_steps < 0:
            raise ValueError(f"backprop_steps: must be >= 0, got {backprop_steps}")
        readouts = sorted(set(readout_depths)) if readout_depths is not None else [depth]
        if readouts[0] < 1 or readouts[-1] > depth:
            raise ValueError(f"readout_depths: must lie in 1..{depth}, got {readouts}")
        grad = torch.is_grad_enabled()
        frozen_steps = depth - backprop_steps if 0 < backprop_steps < depth else 0
        x, ctx = self.start(s, initial_state, rope)
        states: list[torch.Tensor] = []
        h_prev = self.state(x, ctx).detach() if diagnostics else None
        deviation, motion = [], []
        if diagnostics:
            deviation.append(_row_norm_mean(h_prev - ctx["anchor"]))
        for t in range(depth):
            with torch.set_grad_enabled(grad and t >= frozen_steps):
                if self.checkpoint_steps and torch.is_grad_enabled():
                    # Non-reentrant only: reentrant breaks ZeRO-2/3 and DDP with reused modules.
                    x = checkpoint(self.step, x, ctx, t, use_reentrant=False)
                else:
                    x = self.step(x, ctx, t)
            if t + 1 == frozen_steps:
                x = x.detach()
            if t + 1 in readouts:
                states.append(self.state(x, ctx))
            if diagnostics:
                h = self.state(x, ctx).detach()
                deviation.append(_row_norm_mean(h - ctx["anchor"]))
                motion.append(_row_norm_mean(h - h_prev))
                h_prev = h
        if not diagnostics:
            return tuple(states)
        return (*states, torch.stack(deviation), torch.stack(motion), self._forcing_bias_norm(ctx))

    @torch.no_grad()
    def _forcing_bias_norm(self, ctx: Context) -> torch.Tensor:
        """Mean ||what a zero deviation moves to||: lambda*b for scse, Phi(s) - s otherwise (an
        extra probe call, not counted in core_calls since the output does not depend on it)."""
        if self.kind == "scse":
            return _row_norm_mean(self.forcing_bias_scale * (ctx["response"] - ctx["anchor"]))
        s = ctx["source"]
        return _row_norm_mean(self.phi(s, s, rope=(ctx["cos"], ctx["sin"])) - s)
