"""One optimizer step: its micro-batches, the ranks' agreement on skipping it, the update.
`train()` and the ZeRO parity tool (scse_dist.train.parity) both run it."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, cast

import torch
import torch.distributed as dist


class StepResult(NamedTuple):
    loss_sum: torch.Tensor  # sum over micro-batches of each one's mean loss (detached, fp32)
    micro_batches: int
    skipped: bool  # non-finite loss or gradient on some rank: no update anywhere
    stop: bool  # some rank was asked to stop (preemption): save after this step
    depth: int  # the loop depth the step ran
    z_loss_sum: Optional[torch.Tensor] = None  # the same for train.loss.z_loss's term, else None
    refused: bool = False  # update_gate refused this finite step: no update, `skipped` False
    # what update_gate was shown (None when no gate asked): the loss over ranks, the global
    # gradient norm before clipping
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    # train.loss.depth: the short depth's cross-entropy, summed over the micro-batches that had it
    short_loss_sum: Optional[torch.Tensor] = None
    short_micro_batches: int = 0


# (the step's loss averaged over every rank, its global gradient norm before clipping) -> whether
# to apply the update; called once per step on every rank, with the same numbers on each.
UpdateGate = Callable[[float, float], bool]


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values


def _agree(nonfinite: torch.Tensor, stop_requested: bool, loss_sum: torch.Tensor,
           grad_square_sum: torch.Tensor) -> tuple[bool, bool, float, float]:
    """(any rank saw a non-finite loss/gradient, any rank was asked to stop, the loss sums and
    the squared-gradient sums added over ranks): one all-reduce, so every rank gets the same."""
    flags = torch.stack([nonfinite.float().clamp(max=1),
                         torch.tensor(float(stop_requested)).to(nonfinite),
                         loss_sum.float().to(nonfinite), grad_square_sum.float().to(nonfinite)])
    bad, stop, losses, squares = sum_over_ranks(flags).tolist()
    return bad > 0, stop > 0, losses, squares


def _grad_square_sum(engine: Any) -> torch.Tensor:
    """Sum of squares of p.grad: without a DeepSpeed wrapper (ZeRO-0, fp32) the gradients are
    whole, reduced over ranks and not yet clipped at the boundary (engine.step() clips them)."""
    squares = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters()
               if p.grad is not None]
    return torch.stack(squares).sum() if squares else torch.zeros(())


def _grads_nonfinite(engine: Any) -> torch.Tensor:
    # Without ZeRO nothing checks the reduced gradients; ZeRO-1/2/3 check their own partitions
    # (a NaN/Inf gradient norm skips the step there) and report it via was_step_applied().
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    # a sum of (at least one) tensors is a tensor
    return cast(torch.Tensor, sum((~torch.isfinite(g)).any().float() for g in grads)) \
        if grads else torch.zeros(())


@contextlib.contextmanager
def _shadowed_step(optimizer: Any, make_step: Callable[[Callable[..., Any]], Callable[..., Any]]
                   ) -> Iterator[None]:
    """optimizer.step replaced by make_step(optimizer.step) for the block: an instance attribute
    hides the method. What was there before is put back: torch's LR scheduler keeps its own
    wrapper of step on the instance, which counts the optimizer's steps (and carries a marker
    the scheduler looks for: copied, else it warns that step was overridden)."""
    previous = vars(optimizer).get("step")
    optimizer.step = functools.update_wrapper(make_step(optimizer.step), optimizer.step)
    try:
        yield
    finally:
        if previous is None:
            del optimizer.step
        else:
            optimizer.step = previous


class _GatedUpdate:
    """Shadows the basic optimizer's step (the torch optimizer every DeepSpeed wrapper ends in)
    for one engine.step(): its first call asks the gate, every call does what that said. A
    wrapper (ZeRO-1/2/3, bf16) calls it after computing the global gradient norm and before
    touching any weight (ZeRO-1/2 once per parameter group, ZeRO-3 once per sub-group), so not
    calling it leaves weights and optimizer state as they were; the wrapper then copies its
    unchanged fp32 weights back and clears the gradients. No call (an overflow skip inside
    the wrapper) asks nothing."""

    def __init__(self, engine: Any, gate: UpdateGate, loss: float,
                 boundary_norm: Optional[float]) -> None:
        self.engine, self.gate, self.loss = engine, gate, loss
        self.boundary_norm = boundary_norm  # computed at the boundary when nothing wraps
        self.grad_norm: Optional[float] = None
        self.apply: Optional[bool] = None

    def _decide(self) -> bool:
        norm = self.boundary_norm
        if norm is None:
            norm = getattr(self.engine.optimizer, "_global_grad_norm", None)
            if norm is None:
                raise RuntimeError("train.spike_skip: DeepSpeed computed no global gradient "
                                   "norm for this step (zero_optimization.compute_grad_norm: "
                                   "false in train.engine.deepspeed_config?)")
        self.grad_norm = float(norm)
        # A wrapper that lets a non-finite norm through (bf16 ZeRO-1/2 without its overflow
        # check) must not update either; the step then counts as non-finite.
        return math.isfinite(self.grad_norm) and self.gate(self.loss, self.grad_norm)

    def _gated(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.apply is None:
                self.apply = self._decide()
            return original(*args, **kwargs) if self.apply else None
        return step

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        basics = [self.engine.basic_optimizer]
        backup = getattr(self.engine.optimizer, "backup_optimizer", None)  # ZeRO-3 offload's
        basics += [backup] if backup is not None else []
        with contextlib.ExitStack() as stack:
            for basic in basics:
                stack.enter_context(_shadowed_step(basic, self._gated))
            yield

    @property
    def refused(self) -> bool:
        """The gate was asked and said no (a finite step it did not want)."""
        return self.apply is False and self.grad_norm is not None \
            and math.isfinite(self.grad_norm)

    @property
    def nonfinite(self) -> bool:
        return self.grad_norm is not None and not math.isfinite(self.grad_norm)


def train_step(engine: Any, windows: Iterable[torch.Tensor], *, depth: Optional[int],
               backprop_steps: int = 0, stop_requested: Callable[[], bool] = lambda: False,
               loss_hook: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
               before_update: Callable[[Any], None] = lambda engine: None,
               z_loss: float = 0.0, eos_id: Optional[int] = None,
               update_gate: Optional[UpdateGate] = None, short_depth: int = 0,
               short_weight: float = 0.0) -> StepResult:
    """Run one optimizer step of `engine` over `windows`, its gradient-accumulation micro-batches.

    Each window is a (B, S+1) token tensor (inputs [:, :-1], targets [:, 1:]); there must be
    exactly engine.gradient_accumulation_steps() of them. Before the update the ranks agree, in
    one all-reduce, whether any saw a non-finite loss (at ZeRO-0 also gradient): such a step
    updates nothing anywhere; and whether any was asked to stop (`stop_requested()`).
    `loss_hook` sees each micro-batch's loss before backward (fault injection);
    `before_update(engine)` runs at the boundary with the gradients complete. `z_loss` and
    `short_depth`/`short_weight` (train.loss) add terms to the objective, each summed on its own;
    `eos_id` (model.document_mask) confines attention to each window's documents.
    `update_gate(loss, grad_norm)` (train.spike_skip) is asked once per finite step inside
    engine.step(), with the same numbers on every rank; False leaves weights and optimizer state
    as they were (StepResult.refused) while data, step count and LR schedule advance.
    """
    accum = engine.gradient_accumulation_steps()
    stage0 = engine.zero_optimization_stage() == 0
    loss_sum = torch.zeros((), device=engine.device)
    z_sum = torch.zeros((), device=engine.device) if z_loss else None
    local_bad = torch.zeros((), device=engine.device)
    bad = stop = False
    # no DeepSpeed wrapper (ZeRO-0, fp32): nothing computes the global gradient norm but us
    unwrapped = engine.optimizer is getattr(engine, "basic_optimizer", engine.optimizer)
    gated: Optional[_GatedUpdate] = None
    ran_depth, micro = 0, 0
    short = short_depth if short_depth and depth is not None and short_depth < depth else 0
    short_sum = torch.zeros((), device=engine.device) if short_depth else None
    for micro, window in enumerate(windows, start=1):
        if micro > accum:
            raise ValueError(f"train_step: more micro-batches than "
                             f"gradient_accumulation_steps={accum}")
        window = window.to(engine.device)
        kwargs: dict[str, Any] = {"z_loss": z_loss} if z_loss else {}
        if eos_id is not None:
            kwargs["document_ids"] = engine.module.documents(window[:, :-1], eos_id)
        if short:
            kwargs["readout_depths"] = [short]
        out = engine(window[:, :-1], window[:, 1:], depth=depth, backprop_steps=backprop_steps,
                     keep_logits=False, **kwargs)
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
            squares = _grad_square_sum(engine) if update_gate is not None and unwrapped \
                else torch.zeros(())
            bad, stop, losses, global_squares = _agree(local_bad, stop_requested(), loss_sum,
                                                       squares)
            before_update(engine)
            if update_gate is not None and not bad:
                world = dist.get_world_size() if dist.is_initialized() else 1
                # unwrapped, every rank's p.grad is the same reduced gradient: its sum over ranks
                # is world times one
                gated = _GatedUpdate(engine, update_gate, losses / (accum * world),
                                     math.sqrt(global_squares / world) if unwrapped else None)
        # Without ZeRO nothing could skip a non-finite step (and clipping needs the gradients):
        # the optimizer's own step is shadowed by a no-op; engine.step() still clears them.
        with _shadowed_step(engine.optimizer, lambda original: lambda *args, **kwargs: None) \
                if bad and stage0 else contextlib.nullcontext(), \
                gated.installed() if gated is not None and micro == accum \
                else contextlib.nullcontext():
            engine.step()
    if micro != accum:
        raise ValueError(f"train_step: got {micro} micro-batches, expected "
                         f"gradient_accumulation_steps={accum}")
    skipped = bad or (gated is not None and gated.nonfinite) or not engine.was_step_applied()
    return StepResult(loss_sum, accum, skipped, stop, ran_depth, z_sum,
                      gated is not None and gated.refused, None if gated is None else gated.loss,
                      None if gated is None else gated.grad_norm, short_sum,
                      accum if short else 0)
