"""Non-finite steps: count the skipped ones, say so on rank 0, stop after too many in a row.
The counts are its state: they go on across a resume."""

from __future__ import annotations

from typing import Any

from scse_dist.checkpoint.tags import tag_for
from scse_dist.config import RunConfig
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.faults import NonFiniteCounter


class NonFiniteCallback(Callback):
    """train.max_nonfinite_steps skipped steps in a row raise TrainingStopped (exit 3), leaving
    the last good checkpoint as it was. Runs before the metrics callback, which logs the count."""

    priority = 500

    def __init__(self, max_in_a_row: int) -> None:
        self.counter = NonFiniteCounter(max_in_a_row)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> NonFiniteCallback:
        return cls(cfg.train.max_nonfinite_steps)

    def state_dict(self) -> dict[str, Any]:
        # a resume mid-streak goes on counting it: a run preempted between bad steps still stops
        return {"total": self.counter.total, "in_a_row": self.counter.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter.total, self.counter.in_a_row = int(state["total"]), int(state["in_a_row"])

    def on_start(self, state: TrainState) -> None:
        state.skipped_steps = self.counter.total

    def on_step_end(self, state: TrainState) -> None:
        skipped = state.result.skipped
        last = tag_for(state.last_saved) if state.last_saved > 0 else None
        self.counter.update(state.step, skipped, last)
        state.skipped_steps = self.counter.total
        if skipped and state.rank0:
            print(f"step {state.step}: non-finite loss or gradient, step skipped "
                  f"({self.counter.in_a_row} in a row, {self.counter.total} in all)", flush=True)
