"""Loop diagnostics: the numbers that show an SCSE loop collapsing while it trains (issue 17).

`loop_diagnostics(model, window, depth, max_depth)`: one no-grad pass on a fixed held-out batch.
`gradient_shares(model, grad_of)`: where the gradient norm sits, after backward and before the
optimizer step. `update_ratios(model, before, weight_of)`: ||dW|| / ||W|| of the last optimizer step
per parameter group (scse_dist.param_groups), from `weights_snapshot` taken before it. All
return flat {name: float} dicts with stable keys (KEYS_DOC); how to read
them: docs/loop-diagnostics.md. `DiagnosticsCallback` runs them every `train.diagnostics_every`
steps and hands the trainer one metrics row.

Norms are per token (L2 over d_model), then averaged over the batch's tokens: |X| below is
mean_tokens ||X_token||_2. Ratios of such means are ratios of means, not means of ratios.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F

from scse_dist.model.loss import chunked_cross_entropy
from scse_dist.param_groups import group_of
from scse_dist.train.core_probes import phi_jacobian, sublayer_ratios

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

PREFIX = "diag/"
# Measured against D_0: inf, inf and 0 by construction, not by the loop, when D_0 = 0 at every
# token (Transition.starts_at_anchor: looped and additive from the source), so not logged then.
AGAINST_D0 = ("D_ratio_t0", "D_kept", "cos_D0_anchor", "jacobian_gain_D0")
GRAD_GROUPS = ("anchor", "core", "prelude", "coda", "embed")
KEYS_DOC = """\
diag/D_norm_t{t}       |D_t|, t = 0..max_depth; D = h - h* (scse) or h - s (looped, additive)
diag/D_ratio_t{t}      |D_{t+1}| / |D_t| (0 when both are 0, inf when only |D_t| is)
diag/D_kept            |D_T| / |D_0| at the training depth T (what the loop kept of D_0)
                       (D_kept, D_ratio_t0, cos_D0_anchor: not logged for a recurrence that
                       starts at its anchor, D_0 = 0 by construction: Transition.starts_at_anchor)
diag/anchor_norm       R = |h*| (the source s for looped/additive)
diag/core_scale        rho = ||g||_2 = RMS(g) * sqrt(d), g the core's output norm gain
                       (post-LN only: the last core block's norm2; absent under preln)
diag/anchor_over_scale R / rho (post-LN only)
diag/response_norm     |Phi(h*)|: the core's measured output scale at the anchor
diag/source_norm       |s|
diag/cos_D0_anchor     mean over tokens of cos(D_0, h*) (0 for a token with D = 0)
diag/cos_DT_anchor     mean over tokens of cos(D_T, h*) at the training depth T
diag/loss_t1           held-out loss at T = 1
diag/loss_tT           held-out loss at the training depth T
diag/loop_gain         loss_t1 - loss_tT: what the loop's later steps are worth, in nats
diag/grad_norm         the global gradient norm (before clipping)
diag/grad_share_{g}    ||grad_g||^2 / ||grad||^2 for g in anchor, core, prelude, coda, embed
                       (shares of the squared norm, so they sum to 1)
diag/jacobian_norm     largest singular value of J = dPhi/dh at h = h* (JACOBIAN_ITERS power
                       iterations of J^T J from D_0; whole-batch tensor norms)
diag/jacobian_gain_D0  ||J D_0|| / ||D_0||: the step's linear gain along the starting deviation
diag/branch_{attn,mlp}_b{i}  |what core block i's sub-layer adds| / |alpha * its residual input|,
                       in the core call Phi(h*)
diag/update_ratio_{g}  ||W_after - W_before|| / ||W_before|| over group g's parameters, for the
                       optimizer step of this row (g in param_groups.PARAM_GROUPS the model has)
diag/update_ratio_max_{g}  the largest of that ratio over group g's tensors
"""


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


def _loop_deviations(model: LoopedLM, tokens: torch.Tensor, max_depth: int,
                     keep: set[int]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], Any]:
    """[D_0 .. D_max_depth], {t: h_t for t in keep}, and the run's (ctx, rope)."""
    rope = model.rope(tokens)
    core = model.core
    x, ctx = core.start(model.source(tokens, rope), rope=rope)
    deviations, states = [core.deviation(x, ctx)], {}
    for t in range(max_depth):
        x = core.step(x, ctx, t)
        deviations.append(core.deviation(x, ctx))
        if t + 1 in keep:
            states[t + 1] = core.state(x, ctx)
    return deviations, states, (ctx, rope)


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
    `depth` (KEYS_DOC). {} for untied (no loop). One forward of max_depth + 1 core calls (plus
    one for Phi(h*) outside scse) and two read-outs; no gradient, no RNG draw left behind."""
    if model.fixed_depth is not None:
        return {}
    max_depth = max(depth, max_depth or depth)
    tokens, targets = window[:, :-1], window[:, 1:]
    with torch.random.fork_rng(devices=[]):  # init_state=random draws: keep training's RNG
        deviations, states, (ctx, rope) = _loop_deviations(model, tokens, max_depth, {1, depth})
        anchor = ctx["anchor"]
        response = ctx["response"] if "response" in ctx else model.core.phi_ctx(anchor, ctx)
    norms = [float(_row_norms(d).mean()) for d in deviations]
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
    out["cos_D0_anchor"] = _cos(deviations[0], anchor)
    out["cos_DT_anchor"] = _cos(deviations[depth], anchor)
    out.update(_at_the_anchor(model, ctx, deviations[0]))
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


def grad_group(name: str) -> str:
    """The GRAD_GROUPS entry of a LoopedLM parameter name (the final norm and an untied head
    count as coda; a tied head is the embedding)."""
    if name.startswith("core.anchor."):
        return "anchor"
    if name.startswith("core."):
        return "core"  # the shared blocks and the concat adapter
    if name.startswith("prelude."):
        return "prelude"
    if name.startswith("embed."):
        return "embed"
    return "coda"


def gradient_shares(model: torch.nn.Module,
                    grad_of: Callable[[torch.nn.Parameter], Optional[torch.Tensor]]
                    = lambda p: p.grad) -> dict[str, float]:
    """Shares of the squared gradient norm per GRAD_GROUPS entry, and the global norm, from the
    gradients `grad_of(param)` returns (default p.grad; under DeepSpeed ZeRO-1/2 pass
    deepspeed.utils.safe_get_full_grad, which every rank must call: it all-reduces)."""
    sums = dict.fromkeys(GRAD_GROUPS, 0.0)
    for name, param in model.named_parameters():
        grad = grad_of(param)
        if grad is not None:
            sums[grad_group(name)] += float(grad.detach().float().pow(2).sum())
    total = sum(sums.values())
    out = {"grad_norm": math.sqrt(total)}
    out.update({f"grad_share_{g}": (v / total if total > 0 else 0.0) for g, v in sums.items()})
    return {PREFIX + k: v for k, v in out.items()}


WeightOf = Callable[[torch.nn.Parameter], Optional[torch.Tensor]]


def weights_snapshot(model: torch.nn.Module, weight_of: WeightOf = lambda p: p
                     ) -> dict[str, torch.Tensor]:
    """An fp32 copy of every trainable parameter, `weight_of(param)` (default the parameter; under
    DeepSpeed deepspeed.utils.safe_get_full_fp32_param, the optimizer's master weights, which every
    rank must call at ZeRO-1/2: it all-reduces; None falls back to the parameter)."""
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            weight = weight_of(param)
            out[name] = (param if weight is None else weight).detach().float().clone()
    return out


def update_ratios(model: torch.nn.Module, before: dict[str, torch.Tensor],
                  weight_of: WeightOf = lambda p: p) -> dict[str, float]:
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
        weight = weight_of(param)
        now = (param if weight is None else weight).detach().float()
        g = group_of(name)
        dw2, w2 = float((now - before[name]).pow(2).sum()), float(before[name].pow(2).sum())
        moved[g] = moved.get(g, 0.0) + dw2
        size[g] = size.get(g, 0.0) + w2
        largest[g] = max(largest.get(g, 0.0), _ratio(math.sqrt(dw2), math.sqrt(w2)))
    out = {}
    for g in moved:
        out[f"update_ratio_{g}"] = _ratio(math.sqrt(moved[g]), math.sqrt(size[g]))
        out[f"update_ratio_max_{g}"] = largest[g]
    return {PREFIX + k: v for k, v in out.items()}


class DiagnosticsCallback:
    """Every `every` optimizer steps: gradient shares and a copy of the weights at the update
    boundary (before_update, called between the last backward and engine.step), then the update
    ratios against that copy and the loop diagnostics after the step (on_step_end, which returns
    the metrics row's diag/ entries; {} on other steps). The copy lives for that one step only.

    zero_stage 3 is skipped (parameters and gradients are partitioned and the direct calls into
    the model's pieces would bypass ZeRO-3's gathering hooks). At 1-2 every rank computes the
    gradient shares and update ratios (safe_get_full_grad and safe_get_full_fp32_param
    all-reduce); only rank 0 runs the forward pass.
    """

    def __init__(self, every: int, window: Optional[torch.Tensor], depth: int, max_depth: int,
                 zero_stage: int, rank0: bool) -> None:
        self.every, self.window = every, window
        self.depth, self.max_depth = depth, max_depth
        self.enabled = every > 0 and zero_stage < 3
        self.rank0 = rank0
        self._grads: dict[str, float] = {}
        self._before: dict[str, torch.Tensor] = {}

    def due(self, step: int) -> bool:
        """Whether 1-based optimizer step `step` logs diagnostics."""
        return self.enabled and step % self.every == 0

    def before_update(self, engine: Any, step: int) -> None:
        if not self.due(step):
            return
        # The full gradient at any stage 0-2: p.grad, a bf16 optimizer's fp32 buffer, or ZeRO's
        # partitions all-reduced (a collective: every rank gets here at the same steps).
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        self._grads = gradient_shares(engine.module, safe_get_full_grad)
        self._before = weights_snapshot(engine.module, safe_get_full_fp32_param)

    def on_step_end(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        row, self._grads = self._grads, {}
        if self._before:
            from deepspeed.utils import safe_get_full_fp32_param

            row.update(update_ratios(model, self._before, safe_get_full_fp32_param))
            self._before = {}
        if self.rank0 and self.window is not None:
            was_training = model.training
            model.eval()
            try:
                row.update(loop_diagnostics(model, self.window.to(_device_of(model)),
                                            self.depth, self.max_depth))
            finally:
                model.train(was_training)
        return row if self.rank0 else {}


def heldout_window(cfg: Any) -> Optional[torch.Tensor]:
    """The fixed batch: the first eval.batch_size sequences of data.path's held-out split (None,
    with one printed line, when there is none)."""
    from scse_dist.data.stream import TokenStream

    try:
        stream = TokenStream(cfg.data.path, split="heldout", seq_len=cfg.data.seq_len,
                             batch_size=cfg.eval.batch_size, rank=0, world_size=1, seed=0,
                             loop=False)
        return next(iter(stream))
    except (OSError, ValueError, StopIteration) as err:  # InputError is a ValueError
        print(f"loop diagnostics: no held-out batch in {cfg.data.path} ({err}); only gradient "
              "shares are logged", flush=True)
        return None


def diagnostics_for(cfg: Any, zero_stage: int, rank0: bool) -> DiagnosticsCallback:
    """The trainer's DiagnosticsCallback for a RunConfig: every train.diagnostics_every steps
    (null: log_every), T = model.depth, up to the largest trained depth. Off for a model that
    does not loop (untied)."""
    from scse_dist.model.transitions import transition_for
    from scse_dist.train.config import largest_trained_depth

    t, m = cfg.train, cfg.model
    every = t.log_every if t.diagnostics_every is None else t.diagnostics_every
    if not transition_for(m).loops:
        every = 0
    window = heldout_window(cfg) if rank0 and every > 0 and zero_stage < 3 else None
    return DiagnosticsCallback(every, window, m.depth, largest_trained_depth(t.depth, m.depth),
                               zero_stage, rank0)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
