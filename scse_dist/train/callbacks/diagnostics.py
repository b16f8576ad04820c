"""Loop diagnostics as a trainer callback (scse_dist.train.diagnostics; docs/loop-diagnostics.md):
gradient shares at the update boundary, the loop's state on a held-out batch after the step, both
every train.diagnostics_every steps, into that step's metrics row (state.metrics_extra). Their
time counts in the step's (state.step_seconds): the run waits on them, so the logged tokens/s and
MFU do too."""

from __future__ import annotations

import time

from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.diagnostics import diagnostics_for


class LoopDiagnosticsCallback(Callback):
    priority = 400

    def on_start(self, state: TrainState) -> None:
        self.diagnostics = diagnostics_for(state.cfg, state.engine.zero_optimization_stage(),
                                           state.rank0)

    def before_update(self, state: TrainState) -> None:
        self.diagnostics.before_update(state.engine, state.step + 1)

    def on_step_end(self, state: TrainState) -> None:  # before MetricsCallback (300) reads the time
        started = time.perf_counter()
        state.metrics_extra.update(self.diagnostics.on_step_end(state.engine.module, state.step))
        state.step_seconds += time.perf_counter() - started
