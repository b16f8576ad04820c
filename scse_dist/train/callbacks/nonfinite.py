"""Non-finite steps: count the skipped ones, say so on rank 0, stop after too many in a row."""

from __future__ import annotations

from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.checkpoint.tags import tag_for
from scse_dist.train.faults import NonFiniteCounter


class NonFiniteCallback(Callback):
    """train.max_nonfinite_steps skipped steps in a row raise TrainingStopped (exit 3), leaving
    the last good checkpoint as it was. Runs before the metrics callback, which logs the count."""

    def __init__(self, max_in_a_row: int) -> None:
        self.counter = NonFiniteCounter(max_in_a_row)

    def on_step_end(self, state: TrainState) -> None:
        skipped = state.result.skipped
        last = tag_for(state.last_saved) if state.last_saved > 0 else None
        self.counter.update(state.step, skipped, last)
        state.skipped_steps = self.counter.total
        if skipped and state.rank0:
            print(f"step {state.step}: non-finite loss or gradient, step skipped "
                  f"({self.counter.in_a_row} in a row, {self.counter.total} in all)", flush=True)
