"""Per-token exit rules for adaptive loop depth (eval and generation; no gradients).

A rule decides, after each loop step, which tokens stop iterating:
  fixed        never early: every token runs max_steps
  kl:tau       KL(p_t-1 || p_t) < tau between the read-outs (log-probs) of consecutive steps
  motion:tau   ||D_t - D_t-1|| / ||D_t-1|| < tau, D = h - anchor (LoopCore.anchor_of: scse's
               learned h*, the source s for the other kinds). No read-out per step: cheap.
Each has min_steps (no exit before) and max_steps (always exit there; None: the run's depth).
Text form, for command lines: "fixed", "kl:0.01", "motion:0.02", optionally ",min=2,max=32".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # imported where a rule is applied, so a command line parses a rule without it
    import torch

EXIT_KINDS = ("fixed", "kl", "motion")


@dataclass(frozen=True)
class ExitRule:
    kind: str  # one of EXIT_KINDS
    threshold: float = 0.0
    min_steps: int = 1
    max_steps: Optional[int] = None  # None: the depth of the run

    def __post_init__(self) -> None:
        if self.kind not in EXIT_KINDS:
            raise ValueError(f"exit rule: kind must be one of {', '.join(EXIT_KINDS)}; "
                             f"got {self.kind!r}")
        if not self.threshold >= 0:  # also rejects NaN
            raise ValueError(f"exit rule: threshold must be >= 0, got {self.threshold}")
        if self.min_steps < 1:
            raise ValueError(f"exit rule: min must be >= 1, got {self.min_steps}")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(f"exit rule: max must be >= min ({self.min_steps}), "
                             f"got {self.max_steps}")

    @property
    def needs_readout(self) -> bool:
        """Whether the rule reads log-probs at every step (coda + head per step)."""
        return self.kind == "kl"

    def cap(self, depth: int) -> int:
        """The most steps a run of `depth` takes under this rule."""
        return depth if self.max_steps is None else self.max_steps

    def with_max(self, depth: int) -> "ExitRule":
        """This rule with max_steps filled from the run's depth when unset."""
        return self if self.max_steps is not None else replace(self, max_steps=depth)

    def __str__(self) -> str:
        """The text form (parse_exit_rule's inverse)."""
        text = self.kind if self.kind == "fixed" else f"{self.kind}:{self.threshold:g}"
        if self.min_steps != 1:
            text += f",min={self.min_steps}"
        if self.max_steps is not None:
            text += f",max={self.max_steps}"
        return text

    def exited(self, step: int, d_prev: torch.Tensor, d_new: torch.Tensor,
               logp_prev: Optional[torch.Tensor] = None,
               logp_new: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(...,) bool per token: whether it stops after `step` steps (1-based, counted after the
        update d_prev -> d_new). d_*: (..., d) deviations from the anchor; logp_*: (..., V)
        log-probs of the read-outs at steps step-1 and step (kl only)."""
        import torch

        shape = d_new.shape[:-1]
        if self.max_steps is not None and step >= self.max_steps:
            return torch.ones(shape, dtype=torch.bool, device=d_new.device)
        if self.kind == "fixed" or step < self.min_steps:
            return torch.zeros(shape, dtype=torch.bool, device=d_new.device)
        if self.kind == "kl":
            if logp_prev is None or logp_new is None:
                raise ValueError("exit rule kl: needs the log-probs of both steps")
            logp_prev, logp_new = logp_prev.float(), logp_new.float()
            # >= 0 in exact arithmetic; rounding can dip below, which tau = 0 must not count
            kl = (logp_prev.exp() * (logp_prev - logp_new)).sum(-1).clamp(min=0)
            return kl < self.threshold
        motion = (d_new.float() - d_prev.float()).norm(dim=-1)
        size = d_prev.float().norm(dim=-1)
        # a token at its anchor that stays there has relative motion 0; one that leaves, inf
        relative = torch.where(size > 0, motion / size.clamp(min=torch.finfo(size.dtype).tiny),
                               torch.where(motion > 0, torch.inf, 0.0))
        return relative < self.threshold


def parse_exit_rule(text: str) -> ExitRule:
    """"fixed" | "kl:TAU" | "motion:TAU", then optional ",min=N" and ",max=N"."""
    head, *options = [part.strip() for part in text.split(",")]
    kind, sep, tau = head.partition(":")
    if kind not in EXIT_KINDS:
        raise ValueError(f"exit rule {text!r}: unknown kind {kind!r}; expected one of "
                         f"{', '.join(EXIT_KINDS)} (e.g. motion:0.02)")
    if kind == "fixed":
        if sep:
            raise ValueError(f"exit rule {text!r}: fixed takes no threshold, got {head!r}")
        threshold = 0.0
    else:
        try:
            threshold = float(tau)
        except ValueError:
            raise ValueError(f"exit rule {text!r}: {kind} needs a numeric threshold "
                             f"'{kind}:TAU', got {head!r}") from None
    bounds: dict[str, int] = {}
    for option in options:
        key, eq, value = option.partition("=")
        if key not in ("min", "max") or not eq:
            raise ValueError(f"exit rule {text!r}: unknown option {option!r}; expected min=N or "
                             "max=N")
        try:
            bounds[key] = int(value)
        except ValueError:
            raise ValueError(f"exit rule {text!r}: {key} must be an integer, got {option!r}"
                             ) from None
    try:
        return ExitRule(kind, threshold, bounds.get("min", 1), bounds.get("max"))
    except ValueError as err:
        raise ValueError(f"exit rule {text!r}: {str(err).removeprefix('exit rule: ')}") from None
