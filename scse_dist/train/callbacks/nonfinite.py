"""Non-finite steps: count the skipped ones, say so on rank 0, stop after too many in a row.
The counts are its state: they go on across a resume (a run preempted mid-streak still stops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scse_dist.train.callbacks.base import Callback, TrainState


class NonFiniteCallback(Callback):
    """`max_in_a_row` skipped steps in a row raise TrainingStopped (exit 3), leaving the last
    good checkpoint as it was. Runs before the metrics callback, which logs the count."""

    @dataclass
    class Config:
        # non-finite (skipped) steps in a row that stop the run: exit 3
        max_in_a_row: int = field(default=5, metadata={"gt": 0})

    priority = 500

    def __init__(self, config: Config) -> None:
        self.max_in_a_row = config.max_in_a_row
        self.total = self.in_a_row = 0

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])

    def on_start(self, state: TrainState) -> None:
        state.skipped_steps = self.total

    def on_step_end(self, state: TrainState) -> None:
        skipped = state.result.skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += skipped
        if self.in_a_row >= self.max_in_a_row:  # torch-free module: config checks import it
            from scse_dist.checkpoint.tags import tag_for
            from scse_dist.train.faults import NONFINITE_EXIT_CODE, TrainingStopped

            last = tag_for(state.last_saved) if state.last_saved > 0 else "none"
            raise TrainingStopped(
                f"step {state.step}: {self.in_a_row} non-finite steps in a row "
                f"(train.callbacks.nonfinite.init_args.max_in_a_row={self.max_in_a_row}); stopping "
                f"without saving, last "
                f"good checkpoint: {last}", NONFINITE_EXIT_CODE)
        state.skipped_steps = self.total
        if skipped and state.rank0:
            print(f"step {state.step}: non-finite loss or gradient, step skipped "
                  f"({self.in_a_row} in a row, {self.total} in all)", flush=True)
