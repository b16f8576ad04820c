"""The loop: `LoopCore` holds the shared core blocks, the anchor and the concat adapter.

It runs the whole recurrence in one `forward`, so training registers it as a ZeRO-3 leaf module:
its parameters are gathered once per forward/backward whatever the depth. The recurrence itself
is a `Transition` (transitions.py), to which LoopCore passes itself as the `Core` protocol.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, NamedTuple, Optional, Sequence, cast

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from .blocks import Block, KVHook, RopeTables, rope_tables
from .config import ModelConfig
from .documents import AttnMask
from .exit_rules import ExitRule
from .kv_cache import LoopKV
from .transitions import Context, Transition, check_model_config

# loop_stability's hinge floor on |D_T| / |D_0| per token: keeping half is not penalised
STABILITY_FLOOR = 0.5


def loop_step_label(t: int, suffix: str = "") -> ContextManager[Any]:
    """`loop_step_{t}{suffix}` around loop step t in a profiler trace (docs/monitoring.md); a null
    context without an active profiler, where record_function would still cost time."""
    if torch.autograd._profiler_enabled():
        return record_function(f"loop_step_{t}{suffix}")
    return contextlib.nullcontext()


def _labelled_recompute(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`step` for a checkpointed loop step: the first call is the forward (labelled by the loop);
    a later one, the backward's recomputation, is labelled loop_step_{t}_recompute."""
    calls = 0

    def run(x: torch.Tensor, ctx: Context, t: int) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 1:
            return step(x, ctx, t)
        with loop_step_label(t, "_recompute"):
            return step(x, ctx, t)
    return run


def _row_norm_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the per-token L2 norm, in fp32."""
    return x.detach().float().norm(dim=-1).mean()


def stability_penalty(d_first: torch.Tensor, d_before: torch.Tensor, d_last: torch.Tensor,
                      floor: float = STABILITY_FLOOR) -> torch.Tensor:
    """The loop_stability term, unweighted, from deviations D_0, D_{T-1}, D_T (B, S, d):
    mean over tokens with D_0 != 0 of (floor - |D_T|/|D_0|)_+, plus the mean over tokens of the
    late motion |D_T - D_{T-1}| / |D_T| (0 where D_T = 0). D_0 is only a scale: no gradient."""
    tiny = torch.finfo(torch.float32).tiny
    n_first = d_first.detach().float().norm(dim=-1)
    n_last = d_last.float().norm(dim=-1)
    moving = (n_first > 0).float()
    hinge = ((floor - n_last / n_first.clamp(min=tiny)).clamp(min=0) * moving).sum() \
        / moving.sum().clamp(min=1)
    late = ((d_last - d_before).float().norm(dim=-1) / n_last.clamp(min=tiny)).mean()
    return hinge + late


class LoopTrace(NamedTuple):
    """LoopCore.trace's run; norms are means over tokens of the per-token L2 norm, in fp32."""

    deviation_norm: torch.Tensor  # (depth + 1,): |h_t - anchor| for t = 0..depth
    motion_norm: torch.Tensor  # (depth,): |h_t - h_{t-1}| for t = 1..depth
    states: dict[int, torch.Tensor]  # h_t for the depths asked to keep
    ctx: Context  # the run's context: source, anchor, RoPE, what the transition adds


class LoopCore(nn.Module):
    def __init__(self, cfg: ModelConfig, transition: Optional[Transition] = None) -> None:
        """transition: the model's, checked; a core built on its own makes one."""
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.transition = transition or check_model_config(cfg)
        self.inject = self.transition.resolved_inject
        self.init_state = cfg.init_state
        self.checkpoint_steps = cfg.activation_checkpointing == "loop"
        self.n_core = cfg.n_core
        self.fixed_depth: Optional[int] = self.transition.fixed_depth
        ckpt_blocks = cfg.activation_checkpointing == "block"
        self.blocks = nn.ModuleList(Block(cfg, ckpt_blocks, self.transition)
                                    for _ in range(cfg.n_core * self.transition.block_groups))
        self.anchor: Optional[nn.Linear] = None
        if self.transition.learned_anchor:
            self.anchor = nn.Linear(d, d, bias=False)
            # Orthogonal: h* = Q s keeps each token's norm (a zero init blows up RMSNorm's
            # gradients at 0), and D_0 = s - Q s is O(|s|) and not parallel to h* (identity gives
            # D_0 = 0; c*I gives D_0 parallel to h*, which the first Post-LN norm erases).
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
        return self.transition.anchor(self, s)

    def phi(self, h: torch.Tensor, s: torch.Tensor, t: int = 0,
            rope: Optional[RopeTables] = None, mask: Optional[AttnMask] = None,
            kv: Optional[Sequence[KVHook]] = None) -> torch.Tensor:
        """One core application Phi(h); `t` picks the block group (only untied has several).
        mask: the attention mask of LoopedLM.forward (None: plain causal). kv: one KVHook per
        core block (from ctx["kv"], see phi_ctx; None: the plain path)."""
        rope = rope_tables(h.shape[-2], self.cfg, h.device) if rope is None else rope
        if self.inject == "add":
            h = h + s
        elif self.inject == "concat":
            assert self.adapter is not None  # made for inject: concat
            h = self.adapter(torch.cat([h, s], dim=-1))
        first = self.transition.group(t) * self.n_core
        for i in range(self.n_core):
            # indexed, not sliced: a ModuleList slice builds a new module per call (slow decoding)
            block = self.blocks[first + i]
            h = block(h, rope, mask) if kv is None else block(h, rope, mask, kv[i])
        return h

    def phi_ctx(self, h: torch.Tensor, ctx: Context, t: int = 0, response: bool = False
                ) -> torch.Tensor:
        """Phi with this forward's source, RoPE and mask, and, when decoding with a KV cache, the
        cache's hooks for this call: loop step t, or scse's r* = Phi(h*) call (`response`)."""
        kv = ctx["kv"].hooks(t, response) if "kv" in ctx else None
        return self.phi(h, ctx["source"], t, (ctx["cos"], ctx["sin"]), ctx.get("mask"), kv)

    def initial_state(self, s: torch.Tensor) -> torch.Tensor:
        """H0 by cfg.init_state."""
        if self.init_state == "source":
            return s
        if self.init_state == "zeros":
            return torch.zeros_like(s)
        # random: scaled to the source's RMS so it is neither negligible nor dominant.
        return torch.randn_like(s) * s.detach().float().pow(2).mean().sqrt().to(s.dtype)

    def start(self, s: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
              rope: Optional[RopeTables] = None, mask: Optional[AttnMask] = None,
              kv: Optional[LoopKV] = None) -> tuple[torch.Tensor, Context]:
        """The loop variable x_0 and the per-forward context (source, anchor, RoPE's cos/sin,
        the attention mask and KV cache view if any, and what the transition adds: scse's r* and
        ref)."""
        h0 = self.initial_state(s) if initial_state is None else initial_state
        cos, sin = rope_tables(s.shape[-2], self.cfg, s.device) if rope is None else rope
        ctx: Context = {"source": s, "anchor": self.anchor_of(s), "cos": cos, "sin": sin}
        if mask is not None:
            ctx["mask"] = mask
        if kv is not None:
            ctx["kv"] = kv
        return self.transition.start(self, h0, ctx), ctx

    def step(self, x: torch.Tensor, ctx: Context, t: int = 0) -> torch.Tensor:
        """x_t -> x_{t+1} (x is the deviation D for scse, the state h otherwise)."""
        return self.transition.step(self, x, ctx, t)

    def state(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h_t from the loop variable."""
        return self.transition.state(x, ctx)

    def deviation(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """D_t = h_t - anchor (scse: h*; the others: the source s), as the motion exit rule."""
        return self.state(x, ctx) - ctx["anchor"]

    def output_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The core's output norm (the last core block's norm2): under Post-LN every Phi output
        leaves through it, so its RMS gain times sqrt(d) is the output scale rho."""
        return cast(Block, self.blocks[self.n_core - 1]).norm2(h)

    # ------------------------------------------------------------------ the whole loop

    def core_calls(self, depth: int) -> int:
        """Phi applications of a forward to `depth` (scse: r* once more)."""
        return self.transition.core_calls(depth)

    def forward(self, s: torch.Tensor, depth: int, readout_depths: Optional[Iterable[int]] = None,
                backprop_steps: int = 0, initial_state: Optional[torch.Tensor] = None,
                rope: Optional[RopeTables] = None,
                mask: Optional[AttnMask] = None, exit_rule: Optional[ExitRule] = None,
                log_probs: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                stability: bool = False) -> tuple[torch.Tensor, ...]:
        """Run `depth` steps once. Returns a flat tuple: h_t for t in sorted(readout_depths)
        (default (depth,)), then, if stability, cfg.loop_stability * stability_penalty(D_0,
        D_{depth-1}, D_depth). A tuple, not a dict: torch calls the full backward hook that
        reduces a ZeRO-3 leaf's gradients only for Tensor or tuple outputs.
        backprop_steps=k in (0, depth): the first depth-k steps run without grad and the state is
        detached before the last k (the anchor and r* keep their grad).
        rope, mask: from the model's forward (None: made here; plain causal attention).
        exit_rule: adaptive depth (see adaptive); returns (h, steps_used) instead.
        """
        if exit_rule is not None:
            return self.adaptive(s, depth, exit_rule, rope, mask, log_probs)
        if backprop_steps < 0:
            raise ValueError(f"backprop_steps: must be >= 0, got {backprop_steps}")
        readouts = sorted(set(readout_depths)) if readout_depths is not None else [depth]
        if readouts[0] < 1 or readouts[-1] > depth:
            raise ValueError(f"readout_depths: must lie in 1..{depth}, got {readouts}")
        grad = torch.is_grad_enabled()
        frozen_steps = depth - backprop_steps if 0 < backprop_steps < depth else 0
        x, ctx = self.start(s, initial_state, rope, mask)
        states: list[torch.Tensor] = []
        d_first = self.deviation(x, ctx) if stability else None
        d_before = d_first
        for t in range(depth):
            if stability and t == depth - 1:
                d_before = self.deviation(x, ctx)
            with torch.set_grad_enabled(grad and t >= frozen_steps), loop_step_label(t):
                if self.checkpoint_steps and torch.is_grad_enabled():
                    # Non-reentrant only: reentrant breaks ZeRO-2/3 and DDP with reused modules.
                    x = checkpoint(_labelled_recompute(self.step), x, ctx, t, use_reentrant=False)
                else:
                    x = self.step(x, ctx, t)
            if t + 1 == frozen_steps:
                x = x.detach()
            if t + 1 in readouts:
                states.append(self.state(x, ctx))
        outs = tuple(states)
        if stability:
            assert d_first is not None and d_before is not None  # set above under stability
            penalty = stability_penalty(d_first, d_before, self.deviation(x, ctx))
            outs += (self.cfg.loop_stability * penalty,)
        return outs

    @torch.no_grad()
    def trace(self, s: torch.Tensor, depth: int, keep: Iterable[int] = (),
              rope: Optional[RopeTables] = None) -> LoopTrace:
        """The loop run `depth` steps from `s` without grad, for the diagnostics: norms at every
        step, h_t for t in `keep`."""
        x, ctx = self.start(s, rope=rope)
        h_prev = self.state(x, ctx)
        states = {0: h_prev} if 0 in keep else {}
        deviation, motion = [_row_norm_mean(h_prev - ctx["anchor"])], []
        for t in range(depth):
            x = self.step(x, ctx, t)
            h = self.state(x, ctx)
            deviation.append(_row_norm_mean(h - ctx["anchor"]))
            motion.append(_row_norm_mean(h - h_prev))
            if t + 1 in keep:
                states[t + 1] = h
            h_prev = h
        return LoopTrace(torch.stack(deviation), torch.stack(motion), states, ctx)

    @torch.no_grad()
    def forcing_bias_norm(self, ctx: Context) -> torch.Tensor:
        """Mean ||what a zero deviation moves to||: lambda*b for scse, Phi(s) - s otherwise."""
        return _row_norm_mean(self.transition.forcing_bias(self, ctx))

    # ------------------------------------------------------------------ adaptive depth, decoding

    @torch.no_grad()
    def adaptive(self, s: torch.Tensor, depth: int, rule: Optional[ExitRule],
                 rope: Optional[RopeTables] = None, mask: Optional[AttnMask] = None,
                 log_probs: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 kv: Optional[LoopKV] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token exit, teacher-forced and batched (eval; no grad): up to rule.cap(depth) steps;
        a token whose rule fires keeps its loop variable and its latest K/V (LoopKV.active); the
        loop stops once every token has exited. Returns h and steps_used (B, S) long.
        log_probs(h) -> (B, S, V): the per-step read-out rule.needs_readout asks for. rule None:
        `depth` steps for all.
        kv: a KV cache's view (decode_step); None: one that only carries exited tokens' K/V.
        """
        if rule is not None and rule.needs_readout and log_probs is None:
            raise ValueError(f"exit rule {rule}: needs a read-out per step (log_probs)")
        kv = LoopKV(None, self) if kv is None else kv
        x, ctx = self.start(s, None, rope, mask, kv)
        active = torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
        steps_used = torch.zeros(s.shape[:-1], dtype=torch.long, device=s.device)
        readout = rule is not None and rule.needs_readout
        h = self.state(x, ctx)
        # readout implies log_probs (checked above)
        d_prev, logp_prev = h - ctx["anchor"], \
            log_probs(h) if readout and log_probs is not None else None
        steps_run = 0
        for t in range(depth if rule is None else rule.cap(depth)):
            if not bool(active.any()):
                break  # every token has exited: the remaining steps would change nothing
            if rule is None:
                x = self.step(x, ctx, t)
            else:
                kv.active = active
                x = torch.where(active[..., None], self.step(x, ctx, t), x)
            steps_used += active
            steps_run = t + 1
            h = self.state(x, ctx)
            if rule is not None:
                d_new, logp_new = h - ctx["anchor"], \
                    log_probs(h) if readout and log_probs is not None else None
                active = active & ~rule.exited(t + 1, d_prev, d_new, logp_prev, logp_new)
                d_prev, logp_prev = d_new, logp_new
        kv.active = None
        kv.finish(steps_run)
        return h, steps_used
