"""A trainer callback that writes the wall-clock time at the end of every step, after every other
callback's hooks (lowest priority): the rate a user sees, against the logged tokens/s."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from scse_dist.train.callbacks import Callback, TrainState


class StepEnds(Callback):
    @dataclass
    class Config:
        out: str

    priority = -1000

    def __init__(self, config: Config) -> None:
        self.out, self.ends = config.out, {}

    def on_step_end(self, state: TrainState) -> None:
        self.ends[state.step] = time.perf_counter()

    def on_train_end(self, state: TrainState) -> None:
        with open(self.out, "w") as f:
            json.dump(self.ends, f)
