"""A toy trainer callback of a user's own, added the way docs/architecture.md says: this module,
named in a config's train.callbacks, and no file of the package touched:

    train:
      callbacks:
        step_counter:                              # a name of your choosing
          class_path: toy_callback:StepCounter     # its module on PYTHONPATH
          init_args: {every_steps: 5}

Every `every_steps` steps it adds to that step's training row how many steps it has seen over the
whole run and the lowest step loss so far: both are its state, so they carry on across resumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scse_dist.train.callbacks import Callback, TrainState, every


class StepCounter(Callback):
    @dataclass
    class Config:
        every_steps: int = 5

    # Before MetricsCallback (300), so that its entries join the row of the same step.
    priority = 350

    def __init__(self, config: Config) -> None:
        self.every_steps = config.every_steps
        self.steps_seen = 0
        self.lowest_loss = math.inf

    def state_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen, "lowest_loss": self.lowest_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_seen, self.lowest_loss = state["steps_seen"], state["lowest_loss"]

    def on_step_end(self, state: TrainState) -> None:
        result = state.result
        self.steps_seen += 1
        if not result.skipped:
            self.lowest_loss = min(self.lowest_loss, float(result.loss_sum) / result.micro_batches)
        if every(self.every_steps, state.step):
            state.metrics_extra.update({"toy/steps_seen": self.steps_seen,
                                        "toy/lowest_loss": self.lowest_loss})
