"""One class per recurrence (cfg.recurrence): how the loop starts, steps and exposes h_t.

With Phi(h) = F(h), F(h + s) or F(W[h; s]) by cfg.inject, and x the loop variable:
  looped / additive   x_0 = H0,        x_{t+1} = Phi(x_t),                          h_t = x_t
  scse                x_0 = H0 - h*,   x_{t+1} = m(x_t) * (Phi(h* + x_t) - ref),    h_t = h* + x_t
                      with h* = anchor(s), r* = Phi(h*) once per forward,
                      ref = r* - lambda * (r* - h*) = h* + (1 - lambda) * b,  b = r* - h*
  untied              like looped, but step t runs its own distinct group of n_core blocks

A transition holds no parameters: `LoopCore` (recurrence.py) owns them all and passes itself as a
`Core`, the protocol below. A transition also says what the config's fields mean for its
recurrence (resolved inject, anchor scale, unrolled depth, `fixed_depth`), so code elsewhere asks
it instead of comparing names. Adding a recurrence is one subclass with a `name`, passed to
`register` (tests/test_toy_extensions.py); model.recurrence accepts the registry's names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from .config import ModelConfig, check_model_fields

if TYPE_CHECKING:  # annotations only: this module stays free of torch (scse_dist.config imports it)
    from collections.abc import Callable, Sequence

    import torch

# Per-forward tensors (source, anchor, cos, sin, mask, ...) and a KV cache's LoopKV view ("kv").
Context = dict[str, Any]


class Core(Protocol):
    """What a transition asks of the loop's module (LoopCore): Phi, and the parameters it owns."""

    @property
    def anchor(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """a(s), the learned anchor map (a d x d linear), where the transition has one."""

    def phi(self, h: torch.Tensor, s: torch.Tensor, t: int = 0,
            rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
            mask: Optional[torch.Tensor] = None, kv: Optional[Sequence[Any]] = None
            ) -> torch.Tensor:
        """One core application Phi(h) (LoopCore.phi)."""

    def phi_ctx(self, h: torch.Tensor, ctx: Context, t: int = 0, response: bool = False
                ) -> torch.Tensor:
        """Phi with this forward's source, RoPE, mask and KV hooks (from ctx)."""

    def output_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The core's output norm (the last core block's norm2)."""


class Transition:
    """looped: x_{t+1} = Phi(x_t), one shared block group; the base of the others."""

    name = "looped"  # its model.recurrence (the registry's key)
    default_inject = "none"  # cfg.inject "default" resolves to this
    extra_core_calls = 0  # Phi applications per forward beyond one per step

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    # ------------------------------------------------------------------ structure

    @property
    def fixed_depth(self) -> Optional[int]:
        """The only depth it runs at, or None when any depth runs (a loop)."""
        return None

    @property
    def block_groups(self) -> int:
        """Distinct groups of n_core blocks held by LoopCore."""
        return 1

    def group(self, t: int) -> int:
        """The block group step t runs."""
        return 0

    @property
    def revisits_blocks(self) -> bool:
        """Whether a forward at the nominal depth runs some core block more than once."""
        return self.fixed_depth is None and self.cfg.depth > 1

    @property
    def resolved_inject(self) -> str:
        """cfg.inject with "default" resolved for this recurrence."""
        return self.cfg.inject if self.cfg.inject != "default" else self.default_inject

    @property
    def unrolled_depth(self) -> int:
        """N = n_prelude + n_core*T + n_coda at the nominal depth (every loop visit counts)."""
        return self._unrolled(self.fixed_depth or self.cfg.depth)

    @property
    def residual_unrolled_depth(self) -> int:
        """The N of the residual constants: unrolled_depth at cfg.residual_depth when set."""
        return self._unrolled(self.fixed_depth or self.cfg.residual_depth or self.cfg.depth)

    def _unrolled(self, steps: int) -> int:
        return self.cfg.n_prelude + self.cfg.n_core * steps + self.cfg.n_coda

    def core_calls(self, depth: int) -> int:
        """Phi applications of a forward to `depth`."""
        return depth + self.extra_core_calls

    def check_depth(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth: must be >= 1, got {depth}")
        if self.fixed_depth is not None and depth != self.fixed_depth:
            raise ValueError(f"depth: recurrence={self.cfg.recurrence} (untied_match="
                             f"{self.cfg.untied_match}) has the fixed depth {self.fixed_depth}, "
                             f"got {depth}")

    @property
    def loops(self) -> bool:
        """Whether it runs at any depth (a loop); False for a fixed stack (fixed_depth set)."""
        return self.fixed_depth is None

    has_anchor = False  # whether it evolves around an anchor h* of its own (else h* is the source)

    @property
    def learned_anchor(self) -> bool:
        """Whether LoopCore holds an anchor map a(s) (a d x d linear)."""
        return False

    @property
    def starts_at_anchor(self) -> bool:
        """Whether D_0 = h_0 - anchor is zero at every token by construction, so that ratios
        against D_0 are undefined rather than numbers the loop produced."""
        return self.cfg.init_state == "source"

    @property
    def resolved_anchor_scale(self) -> str:
        """"free" or "core_norm": cfg.anchor_scale with "auto" resolved for this model."""
        if self.cfg.anchor_scale != "auto":
            return self.cfg.anchor_scale
        # the learned anchor only: "source" and "zero" are ablations it would change
        return "core_norm" if self.learned_anchor and self.cfg.residual != "preln" else "free"

    def own_flops(self) -> float:
        """Forward FLOPs per token outside Phi: the learned anchor's matmul, once."""
        return 2.0 * self.cfg.d_model ** 2 if self.learned_anchor else 0.0

    # ------------------------------------------------------------------ config checks

    def input_enters(self) -> bool:
        m = self.cfg
        return self.resolved_inject != "none" or m.init_state == "source"

    _no_input = ""  # what else keeps the input out, in check's message

    def check_interventions(self) -> None:
        """anchor_scale and loop_stability against what this recurrence has (an anchor, a loop)."""
        m = self.cfg
        if m.anchor_scale == "core_norm":
            if not self.has_anchor:
                raise ValueError(f"model.anchor_scale: only scse has an anchor; got "
                                  f"anchor_scale={m.anchor_scale} with recurrence={m.recurrence}")
            if m.residual == "preln":
                raise ValueError("model.anchor_scale: core_norm needs a Post-LN residual "
                                  "(deepnorm or deeploop), whose core output is normalised; got "
                                  "residual=preln")
            if m.anchor == "zero":
                raise ValueError("model.anchor_scale: core_norm would normalise the zero anchor "
                                  "(RMSNorm at 0); use anchor learned or source")
        if m.loop_stability > 0 and not self.loops:
            raise ValueError(f"model.loop_stability: {m.recurrence} has no loop to keep moving; "
                              "set it to 0")

    def check(self) -> None:
        """Field combinations this recurrence cannot run (ConfigError naming the field)."""
        m = self.cfg
        if not self.input_enters():
            raise ValueError(f"model.inject: recurrence={m.recurrence} with "
                              f"{self._no_input}init_state="
                              f"{m.init_state} and inject=none never sees the input (the loop "
                              "state starts from noise or zeros); use inject add or concat")

    # ------------------------------------------------------------------ the loop

    def anchor(self, core: Core, s: torch.Tensor) -> torch.Tensor:
        """h*: the reference point deviations are measured from (the source s by default)."""
        return s

    def start(self, core: Core, h0: torch.Tensor, ctx: Context) -> torch.Tensor:
        """x_0 from the initial state; may add entries to ctx (once per forward)."""
        return h0

    def step(self, core: Core, x: torch.Tensor, ctx: Context, t: int) -> torch.Tensor:
        """x_t -> x_{t+1}."""
        return core.phi_ctx(x, ctx, t)

    def state(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The readable hidden state h_t from the loop variable x_t."""
        return x

    def forcing_bias(self, core: Core, ctx: Context) -> torch.Tensor:
        """Where a zero deviation moves: Phi(s) - s (an extra probe call, not in core_calls)."""
        s = ctx["source"]
        return core.phi(s, s, 0, (ctx["cos"], ctx["sin"]), ctx.get("mask")) - s


class Looped(Transition):
    pass


class Additive(Transition):
    """looped with the source added before every step (inject add by default)."""

    name = "additive"
    default_inject = "add"


class Untied(Transition):
    """A plain stack: step t runs its own group of n_core blocks, at one fixed depth."""

    name = "untied"

    @property
    def fixed_depth(self) -> Optional[int]:
        return self.block_groups

    @property
    def block_groups(self) -> int:
        return self.cfg.depth if self.cfg.untied_match == "depth" else 1

    def group(self, t: int) -> int:
        return t

    def check(self) -> None:
        if self.resolved_inject != "none":
            raise ValueError(f"model.inject: untied has no loop to inject into, got "
                              f"{self.cfg.inject!r}")


class Scse(Transition):
    """The deviation D = h - h* from an input-conditioned anchor; r* = Phi(h*) once per forward."""

    name = "scse"
    has_anchor = True
    extra_core_calls = 1
    _no_input = "anchor=zero, "

    @property
    def zero_mask(self) -> bool:
        return self.cfg.zero_mask

    @property
    def learned_anchor(self) -> bool:
        return self.cfg.anchor == "learned"

    @property
    def starts_at_anchor(self) -> bool:  # only with forcing_bias_scale > 0 (check refuses it at 0)
        return (self.cfg.anchor, self.cfg.init_state) in {("source", "source"), ("zero", "zeros")}

    def input_enters(self) -> bool:
        return super().input_enters() or self.cfg.anchor != "zero"

    def check(self) -> None:
        m = self.cfg
        if m.zero_mask and m.forcing_bias_scale > 0:
            raise ValueError("model.zero_mask: the zero-deviation mask belongs to "
                              f"forcing_bias_scale=0; got forcing_bias_scale={m.forcing_bias_scale}"
                              " with zero_mask=true (set model.zero_mask=false)")
        super().check()
        # An anchor equal to the initial state gives D_0 = 0 for every token: with lambda = 0
        # the loop then computes nothing (the spec's first trap).
        if m.forcing_bias_scale == 0 and \
                (m.anchor, m.init_state) in {("source", "source"), ("zero", "zeros")}:
            raise ValueError(f"model.init_state: anchor={m.anchor} with init_state={m.init_state}"
                              " gives D_0 = 0 for every token, so the loop computes nothing; pick "
                              "another init_state")

    def anchor(self, core: Core, s: torch.Tensor) -> torch.Tensor:
        if self.cfg.anchor == "zero":
            return s.new_zeros(s.shape)
        if self.cfg.anchor == "source":
            anchor = s
        else:  # learned: the core has its anchor map
            assert core.anchor is not None
            anchor = core.anchor(s)
        if self.resolved_anchor_scale == "core_norm":
            # through the core's own output norm: |h*| then follows the scale of Phi's output
            anchor = core.output_norm(anchor)
        return anchor

    def start(self, core: Core, h0: torch.Tensor, ctx: Context) -> torch.Tensor:
        anchor = ctx["anchor"]
        # r*: the one extra core call of SCSE
        response = core.phi_ctx(anchor, ctx, 0, response=True)
        ctx["response"] = response
        # lerp is exact at both ends (ref = r* for lambda 0, h* for 1); under autocast the two
        # may differ in dtype and lerp takes one: the wider.
        if response.dtype != anchor.dtype:
            response, anchor = response.float(), anchor.float()
        ctx["ref"] = response.lerp(anchor, self.cfg.forcing_bias_scale)
        return h0 - anchor

    def step(self, core: Core, x: torch.Tensor, ctx: Context, t: int) -> torch.Tensor:
        delta = core.phi_ctx(ctx["anchor"] + x, ctx, t) - ctx["ref"]
        if self.zero_mask:
            # attention mixes rows: this keeps a row at its anchor exactly there (0 * finite = 0);
            # a multiply is one op fewer than masked_fill each way
            delta = delta * (x != 0).any(dim=-1, keepdim=True).to(delta.dtype)
        return delta

    def state(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return ctx["anchor"] + x

    def forcing_bias(self, core: Core, ctx: Context) -> torch.Tensor:
        return self.cfg.forcing_bias_scale * (ctx["response"] - ctx["anchor"])


# model.recurrence -> its Transition; the values the field accepts, in this order.
TRANSITIONS: dict[str, type[Transition]] = {}


def register(cls: type[Transition]) -> type[Transition]:
    """Make `cls` the recurrence model.recurrence=cls.name builds (usable as a class decorator)."""
    if cls.name in TRANSITIONS and TRANSITIONS[cls.name] is not cls:
        raise ValueError(f"recurrence {cls.name!r}: already registered as "
                         f"{TRANSITIONS[cls.name].__name__}")
    TRANSITIONS[cls.name] = cls
    return cls


for _shipped in (Untied, Looped, Additive, Scse):
    register(_shipped)


def transition_for(cfg: ModelConfig) -> Transition:
    try:
        return TRANSITIONS[cfg.recurrence](cfg)
    except KeyError:
        raise ValueError(f"model.recurrence: must be one of {', '.join(TRANSITIONS)}; got "
                          f"{cfg.recurrence!r}") from None


def resolved_anchor_scale(cfg: ModelConfig) -> str:
    """"free" or "core_norm": what anchor_scale "auto" means for this model (its transition's)."""
    return transition_for(cfg).resolved_anchor_scale


def check_model_config(cfg: ModelConfig) -> Transition:
    """Every check of a model config: the fields, then the recurrence's own; returns the checked
    Transition. LoopedLM calls it too, so a ModelConfig built in code gets the same messages."""
    check_model_fields(cfg)
    transition = transition_for(cfg)
    transition.check_interventions()
    transition.check()
    return transition
