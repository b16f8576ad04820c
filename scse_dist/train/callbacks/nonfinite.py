"""Non-finite steps: count the skipped ones, say so on rank 0, stop after too many in a row.
The counts are its state: they go on across a resume (a run preempted mid-streak still stops)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scse_dist.train.callbacks.base import StreakCallback, TrainState


class NonFiniteCallback(StreakCallback):
    """`max_in_a_row` skipped steps in a row raise TrainingStopped (exit 3), leaving the last
    good checkpoint as it was. Runs before the metrics callback, which logs the count."""

    @dataclass
    class Config:
        # non-finite (skipped) steps in a row that stop the run: exit 3
        max_in_a_row: int = field(default=5, metadata={"gt": 0})

    priority = 500

    def __init__(self, config: Config) -> None:
        super().__init__(config.max_in_a_row)

    def on_start(self, state: TrainState) -> None:
        state.skipped_steps = self.total

    def on_step_end(self, state: TrainState) -> None:
        from scse_dist.train.faults import NONFINITE_EXIT_CODE

        skipped = state.result.skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += skipped
        self.end_streak(state, "non-finite steps", "nonfinite", NONFINITE_EXIT_CODE)
        state.skipped_steps = self.total
        if skipped and state.rank0:
            print(f"step {state.step}: non-finite loss or gradient, step skipped "
                  f"({self.in_a_row} in a row, {self.total} in all)", flush=True)
