"""Loop diagnostics: the numbers that show an SCSE loop collapsing while it trains.

`loop_diagnostics`: one no-grad pass on a fixed held-out batch; `gradient_shares`: where the
gradient norm sits before the optimizer step; `update_ratios`: ||dW|| / ||W|| of the last step per
parameter group, against a `weights_snapshot`. Flat {name: float} dicts, their keys explained in
docs/loop-diagnostics.md. Norms are per token (L2 over d_model), averaged over tokens; ratios of
such means are ratios of means.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

from scse_dist.model.loss import chunked_cross_entropy
from scse_dist.param_groups import SHARE_GROUPS, group_of, share_group_of
from scse_dist.train.core_probes import phi_jacobian, sublayer_ratios

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

PREFIX = "diag/"
# Measured against D_0: inf, inf and 0 by construction, not by the loop, when D_0 = 0 at every
# token (Transition.starts_at_anchor: looped and additive from the source), so not logged then.
AGAINST_D0 = ("D_ratio_t0", "D_kept", "cos_D0_anchor", "jacobian_gain_D0")


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    return x.float().norm(dim=-1)


def core_scale(model: LoopedLM) -> Optional[float]:
    """rho: the L2 norm of the core's output-norm gain (= its RMS gain times sqrt(d)). Under
    Post-LN every Phi output leaves through that norm, so a token's ||Phi(h)|| is rho when the
    gain is uniform. None under preln: Phi's output is not normalised there."""
    if model.cfg.residual == "preln":
        return None
    core = model.core
    return float(core.blocks[core.n_core - 1].norm2.weight.detach().float().norm())


def _ratio(after: float, before: float) -> float:
    """after / before; 0 when both are 0 (a zero deviation that stays zero), inf when only
    `before` is (looped/additive start at D_0 = H0 - s = 0 under init_state=source)."""
    if before > 0:
        return after / before
    return 0.0 if after == 0 else math.inf


def _cos(d: torch.Tensor, anchor: torch.Tensor) -> float:
    return float(F.cosine_similarity(d.float(), anchor.float(), dim=-1, eps=1e-12).mean())


@torch.no_grad()
def loop_diagnostics(model: LoopedLM, window: torch.Tensor, depth: int,
                     max_depth: Optional[int] = None) -> dict[str, float]:
    """The loop's state on one batch `window` (B, S+1) of held-out tokens: deviations up to
    `max_depth` (default `depth`), anchor and scale, angles, and the held-out loss at T=1 and at
    `depth`. {} for untied (no loop). One forward of max_depth + 1 core calls (plus
    one for Phi(h*) outside scse) and two read-outs; no gradient, no RNG draw left behind."""
    if model.fixed_depth is not None:
        return {}
    max_depth = max(depth, max_depth or depth)
    tokens, targets = window[:, :-1], window[:, 1:]
    rope = model.rope(tokens)
    with torch.random.fork_rng(devices=[]):  # init_state=random draws: keep training's RNG
        trace = model.core.trace(model.source(tokens, rope), max_depth, {0, 1, depth}, rope)
        ctx, states = trace.ctx, trace.states
        anchor = ctx["anchor"]
        response = ctx["response"] if "response" in ctx else model.core.phi_ctx(anchor, ctx)
    norms = trace.deviation_norm.tolist()
    d0, d_depth = states[0] - anchor, states[depth] - anchor
    out = {f"D_norm_t{t}": n for t, n in enumerate(norms)}
    out.update({f"D_ratio_t{t}": _ratio(norms[t + 1], norms[t]) for t in range(max_depth)})
    out["D_kept"] = _ratio(norms[depth], norms[0])
    out["anchor_norm"] = float(_row_norms(anchor).mean())
    rho = core_scale(model)
    if rho is not None:
        out["core_scale"] = rho
        out["anchor_over_scale"] = out["anchor_norm"] / rho
    out["response_norm"] = float(_row_norms(response).mean())
    out["source_norm"] = float(_row_norms(ctx["source"]).mean())
    out["cos_D0_anchor"] = _cos(d0, anchor)
    out["cos_DT_anchor"] = _cos(d_depth, anchor)
    out.update(_at_the_anchor(model, ctx, d0))
    losses = {t: float(chunked_cross_entropy(model.head_input(states[t], rope), model.head_weight,
                                             targets)) for t in (1, depth)}
    out.update(loss_t1=losses[1], loss_tT=losses[depth], loop_gain=losses[1] - losses[depth])
    undefined = AGAINST_D0 if model.core.transition.starts_at_anchor else ()
    return {PREFIX + k: v for k, v in out.items() if k not in undefined}


def _at_the_anchor(model: LoopedLM, ctx: Any, d0: torch.Tensor) -> dict[str, float]:
    """The core's Jacobian gain and sub-layer ratios at h* (scse_dist.train.core_probes). A zero
    D_0 (a start at the anchor) gives no direction: the power iteration then starts from a fixed
    random one, and the gain along D_0 reads 0."""
    start = d0
    if not bool(d0.any()):
        start = torch.randn(d0.shape, generator=torch.Generator().manual_seed(0)).to(d0)
    out = phi_jacobian(model.core, ctx, start)
    if start is not d0:
        out["jacobian_gain_D0"] = 0.0
    out.update(sublayer_ratios(model.core, ctx, ctx["anchor"]))
    return out


TensorOf = Callable[[torch.nn.Parameter], Optional[torch.Tensor]]


def gradient_shares(model: torch.nn.Module, grad_of: TensorOf = lambda p: p.grad
                    ) -> dict[str, float]:
    """Shares of the squared gradient norm per SHARE_GROUPS entry, and the global norm, from the
    gradients `grad_of(param)` returns (default p.grad; under DeepSpeed ZeRO-1/2 pass
    deepspeed.utils.safe_get_full_grad, which every rank must call: it all-reduces)."""
    sums = dict.fromkeys(SHARE_GROUPS, 0.0)
    for name, param in model.named_parameters():
        grad = grad_of(param)
        if grad is not None:
            sums[share_group_of(name)] += float(grad.detach().float().pow(2).sum())
    total = sum(sums.values())
    out = {"grad_norm": math.sqrt(total)}
    out.update({f"grad_share_{g}": (v / total if total > 0 else 0.0) for g, v in sums.items()})
    return {PREFIX + k: v for k, v in out.items()}


def _fp32(param: torch.nn.Parameter, weight_of: TensorOf) -> torch.Tensor:
    weight = weight_of(param)
    return (param if weight is None else weight).detach().float()


def weights_snapshot(model: torch.nn.Module, weight_of: TensorOf = lambda p: p
                     ) -> dict[str, torch.Tensor]:
    """An fp32 copy of every trainable parameter, `weight_of(param)` (default the parameter; under
    DeepSpeed deepspeed.utils.safe_get_full_fp32_param, the optimizer's master weights, which every
    rank must call at ZeRO-1/2: it all-reduces; None falls back to the parameter)."""
    return {name: _fp32(param, weight_of).clone() for name, param in model.named_parameters()
            if param.requires_grad}


def update_ratios(model: torch.nn.Module, before: dict[str, torch.Tensor],
                  weight_of: TensorOf = lambda p: p) -> dict[str, float]:
    """Per parameter group g (param_groups.group_of): update_ratio_g = ||W - W_before|| /
    ||W_before|| over all of g's entries (W the weights now, `weight_of` as in weights_snapshot),
    and update_ratio_max_g, the largest such ratio of one of g's tensors. A zero weight that
    moves reads inf, one that stays 0."""
    moved: dict[str, float] = {}
    size: dict[str, float] = {}
    largest: dict[str, float] = {}
    for name, param in model.named_parameters():
        if name not in before:
            continue
        now, g = _fp32(param, weight_of), group_of(name)
        dw2, w2 = float((now - before[name]).pow(2).sum()), float(before[name].pow(2).sum())
        moved[g] = moved.get(g, 0.0) + dw2
        size[g] = size.get(g, 0.0) + w2
        largest[g] = max(largest.get(g, 0.0), _ratio(math.sqrt(dw2), math.sqrt(w2)))
    out = {}
    for g in moved:
        out[f"update_ratio_{g}"] = _ratio(math.sqrt(moved[g]), math.sqrt(size[g]))
        out[f"update_ratio_max_{g}"] = largest[g]
    return {PREFIX + k: v for k, v in out.items()}
