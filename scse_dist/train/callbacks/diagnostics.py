"""The loop diagnostics (docs/loop-diagnostics.md) into that step's row
(state.metrics_extra): gradient shares and a weight copy at the update boundary, then the update
ratios and the loop's state on a fixed held-out batch after the step, their time counted in the
step's. Not under ZeRO-3 (direct calls into the model's pieces would bypass its gathering);
at ZeRO-1/2 every rank joins the all-reduces, only rank 0 runs the forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from scse_dist.model.transitions import transition_for
from scse_dist.train.callbacks.base import Callback, TrainState, every
from scse_dist.train.depth_config import largest_trained_depth

if TYPE_CHECKING:  # torch in the hooks only: config checks import this module
    import torch

    from scse_dist.data.config import DataConfig
    from scse_dist.eval.config import EvalConfig
    from scse_dist.model.config import ModelConfig
    from scse_dist.train.config import TrainConfig


class LoopDiagnosticsCallback(Callback):
    """Every every_steps optimizer steps (null: train.log_every) at training depth model.depth,
    the deviations up to the largest trained depth; `window` (B, S+1): the held-out batch (None:
    the first eval.batch_size sequences of data.path's held-out split, read at on_start). Off
    for a model that does not loop (untied)."""

    @dataclass
    class Config:
        # null: train.log_every; 0: off
        every_steps: Optional[int] = field(default=None, metadata={"ge": 0})

    priority = 400

    def __init__(self, config: Config, train: TrainConfig, model: ModelConfig,
                 window: Optional[torch.Tensor] = None) -> None:
        self.every = train.log_every if config.every_steps is None else config.every_steps
        self.depth, self.max_depth = model.depth, largest_trained_depth(train.depth, model.depth)
        self.loops, self.window = transition_for(model).loops, window
        self.enabled, self.rank0 = True, True
        self._grads: dict[str, float] = {}
        self._before: dict[str, torch.Tensor] = {}

    def for_run(self) -> bool:
        return self.every > 0 and self.loops

    def on_start(self, state: TrainState) -> None:
        self.enabled = state.engine.zero_optimization_stage() < 3
        self.rank0 = state.rank0
        if self.window is None and self.rank0 and self.enabled:
            self.window = heldout_window(state.cfg.data, state.cfg.eval)

    def due(self, step: int) -> bool:
        """Whether 1-based optimizer step `step` logs diagnostics."""
        return self.enabled and every(self.every, step)

    def before_update(self, state: TrainState) -> None:
        if not self.due(state.step + 1):
            return
        # The full gradient at any stage 0-2: p.grad, a bf16 optimizer's fp32 buffer, or ZeRO's
        # partitions all-reduced (a collective: every rank gets here at the same steps).
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        from scse_dist.train.diagnostics import gradient_shares, weights_snapshot

        self._grads = gradient_shares(state.engine.module, safe_get_full_grad)
        self._before = weights_snapshot(state.engine.module, safe_get_full_fp32_param)

    def on_step_end(self, state: TrainState) -> None:  # before MetricsCallback (300) reads the time
        if not self.due(state.step):
            return
        from scse_dist.train.diagnostics import loop_diagnostics, update_ratios

        started = time.perf_counter()
        model = state.engine.module
        row, self._grads = self._grads, {}
        if self._before:
            from deepspeed.utils import safe_get_full_fp32_param

            row.update(update_ratios(model, self._before, safe_get_full_fp32_param))
            self._before = {}
        if self.rank0 and self.window is not None:
            was_training = model.training
            model.eval()
            try:
                window = self.window.to(next(model.parameters()).device)
                row.update(loop_diagnostics(model, window, self.depth, self.max_depth))
            finally:
                model.train(was_training)
        if self.rank0:
            state.metrics_extra.update(row)
        state.step_seconds += time.perf_counter() - started


def heldout_window(data: DataConfig, eval: EvalConfig) -> Optional[torch.Tensor]:
    """The fixed batch: the first eval.batch_size sequences of data.path's held-out split (None,
    with one printed line, when there is none)."""
    from scse_dist.data.stream import TokenStream

    try:
        stream = TokenStream(data.path, split="heldout", seq_len=data.seq_len,
                             batch_size=eval.batch_size, rank=0, world_size=1, seed=0,
                             loop=False)
        return next(iter(stream))
    except (OSError, ValueError, StopIteration) as err:  # InputError is a ValueError
        print(f"loop diagnostics: no held-out batch in {data.path} ({err}); only gradient "
              "shares are logged", flush=True)
        return None
