"""One optimizer step: its micro-batches, the ranks' agreement on skipping it, the update.

`train_step` is the single training step of the stack: `train()` and the ZeRO parity tool
(`scse_dist.train.parity`) both call it, so accumulation, loss scaling and the non-finite skip
are the same code wherever a step runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, cast

import torch
import torch.distributed as dist


class StepResult(NamedTuple):
    loss_sum: torch.Tensor  # sum over micro-batches of each one's mean loss (detached, fp32)
    micro_batches: int
    skipped: bool  # non-finite loss or gradient on some rank: no update anywhere
    stop: bool  # some rank was asked to stop (preemption): save after this step
    depth: int  # the loop depth the step ran
    # sum over micro-batches of each one's z-loss term (train.z_loss > 0), else None
    z_loss_sum: Optional[torch.Tensor] = None
    # train.depth_loss two_depths: sum over micro-batches of the cross-entropy at the short depth,
    # and how many micro-batches had it (0 when the step's T <= short), else None
    short_loss_sum: Optional[torch.Tensor] = None
    short_micro_batches: int = 0


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def _agree(nonfinite: torch.Tensor, stop_requested: bool) -> tuple[bool, bool]:
    """(any rank saw a non-finite loss/gradient, any rank was asked to stop): one all-reduce."""
    flags = torch.stack([nonfinite.float().clamp(max=1),
                         torch.tensor(float(stop_requested)).to(nonfinite)])
    bad, stop = sum_over_ranks(flags).tolist()
    return bad > 0, stop > 0


def _grads_nonfinite(engine: Any) -> torch.Tensor:
    # Without ZeRO nothing checks the reduced gradients; ZeRO-1/2/3 check their own partitions
    # (a NaN/Inf gradient norm skips the step there) and report it via was_step_applied().
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    # a sum of (at least one) tensors is a tensor
    return cast(torch.Tensor, sum((~torch.isfinite(g)).any().float() for g in grads)) \
        if grads else torch.zeros(())


@contextlib.contextmanager
def _optimizer_step_skipped(optimizer: Any, skip: bool) -> Iterator[None]:
    """Without ZeRO, DeepSpeed has no overflow check that could skip a step, and its gradient
    clipping needs gradients, so a non-finite step runs engine.step() with the optimizer's own
    step shadowed by a no-op: parameters and optimizer state stay as they were (the LR schedule
    advances). engine.step() still clears the gradients."""
    if not skip:
        yield
        return
    optimizer.step = lambda *args, **kwargs: None  # an instance attribute hides the method
    try:
        yield
    finally:
        del optimizer.step


def train_step(engine: Any, windows: Iterable[torch.Tensor], *, depth: Optional[int],
               backprop_steps: int = 0, stop_requested: Callable[[], bool] = lambda: False,
               loss_hook: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
               before_update: Callable[[Any], None] = lambda engine: None,
               z_loss: float = 0.0, short_depth: int = 0, short_weight: float = 0.0
               ) -> StepResult:
    """Run one optimizer step of `engine` over `windows`, its gradient-accumulation micro-batches.

    Each window is a (B, S+1) token tensor: inputs window[:, :-1], targets window[:, 1:]. There
    must be exactly engine.gradient_accumulation_steps() of them: DeepSpeed divides each
    micro-batch's loss by that count in backward and updates at the last one, so the gradient
    is the mean over the global batch whatever the split into micro-batches.

    Before the update the ranks agree, in one all-reduce, whether any saw a non-finite loss (or,
    at ZeRO stage 0, gradient) and whether any was asked to stop (`stop_requested()`, read at the
    boundary). A non-finite step updates nothing on any rank. `loss_hook` sees each micro-batch's
    loss before backward (fault injection in tests). `before_update(engine)` runs at the
    boundary, after the last backward and before engine.step(), on every rank: the gradients are
    complete there (loop diagnostics read them). `z_loss` > 0 adds that weight's z-loss to
    the objective (the loss summed for logging stays the cross-entropy; the term has its own sum).
    `short_depth` > 0 (train.depth_loss two_depths): where it is below the step's depth, the
    cross-entropy at that depth, read out from the same forward, joins the objective with
    `short_weight` (summed on its own for logging).
    """
    accum = engine.gradient_accumulation_steps()
    stage0 = engine.zero_optimization_stage() == 0
    loss_sum = torch.zeros((), device=engine.device)
    z_sum = torch.zeros((), device=engine.device) if z_loss else None
    local_bad = torch.zeros((), device=engine.device)
    bad = stop = False
    ran_depth, micro = 0, 0
    short = short_depth if short_depth and depth is not None and short_depth < depth else 0
    short_sum = torch.zeros((), device=engine.device) if short_depth else None
    for micro, window in enumerate(windows, start=1):
        if micro > accum:
            raise ValueError(f"train_step: more micro-batches than "
                             f"gradient_accumulation_steps={accum}")
        window = window.to(engine.device)
        out = engine(window[:, :-1], window[:, 1:], depth=depth, backprop_steps=backprop_steps,
                     keep_logits=False, **({"z_loss": z_loss} if z_loss else {}),
                     **({"readout_depths": [short]} if short else {}))
        ran_depth = out.depth
        if z_sum is None:
            loss = objective = loss_hook(out.loss)
        else:  # the objective carries the gradient; out.loss is its cross-entropy part
            objective, loss = loss_hook(out.objective), out.loss
            z_sum += out.z_loss.detach().float()
        # model.loop_stability's term joins the objective; the LM loss alone is what runs log.
        objective = objective if out.aux_loss is None else objective + out.aux_loss
        if short:  # the short depth's loss, a term of the objective
            short_loss = out.loss_by_depth[short]
            objective = objective + short_weight * short_loss
            assert short_sum is not None  # made when short_depth is set
            short_sum += short_loss.detach().float()
        local_bad += (~torch.isfinite(objective.detach())).float()
        loss_sum += loss.detach().float()
        engine.backward(objective)
        if micro == accum:  # the boundary: decide before the update that engine.step() makes
            if stage0:
                local_bad += _grads_nonfinite(engine).to(local_bad)
            bad, stop = _agree(local_bad, stop_requested())
            before_update(engine)
        with _optimizer_step_skipped(engine.optimizer, bad and stage0):
            engine.step()
    if micro != accum:
        raise ValueError(f"train_step: got {micro} micro-batches, expected "
                         f"gradient_accumulation_steps={accum}")
    skipped = bad or not engine.was_step_applied()
    return StepResult(loss_sum, accum, skipped, stop, ran_depth, z_sum, short_sum,
                      accum if short else 0)
