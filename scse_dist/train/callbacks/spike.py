"""Loss spikes (train.spike_skip): the update of a spike is refused (allow_update), the skips
counted, said on rank 0 and logged (`spike_skips`), and too many in a row end the run. The
windows and counts are its state, so a resumed run needs no second warm-up.
"""

from __future__ import annotations

from typing import Any, Optional

from scse_dist.checkpoint.tags import tag_for
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.config import SpikeSkipConfig
from scse_dist.train.faults import SPIKE_EXIT_CODE, TrainingStopped
from scse_dist.train.spike import Spike, SpikeDetector


class SpikeSkipCallback(Callback):
    """train.spike_skip.max_in_a_row refused steps in a row raise TrainingStopped (exit 4),
    leaving the last good checkpoint as it was. Before the metrics callback, which logs the
    count; a non-finite step (the non-finite callback's) neither adds to nor ends a streak."""

    priority = 450
    config_key = "train.spike_skip"

    def __init__(self, cfg: SpikeSkipConfig) -> None:
        self.cfg = cfg
        self.detector = SpikeDetector(cfg)
        self.total = 0
        self.in_a_row = 0
        self._spike: Optional[Spike] = None  # this step's, between allow_update and on_step_end

    def state_dict(self) -> dict[str, Any]:
        return {"stats": self.detector.state_dict(), "total": self.total,
                "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["stats"])
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])

    def on_start(self, state: TrainState) -> None:
        state.spike_skips = self.total

    def allow_update(self, state: TrainState, loss: float, grad_norm: float) -> bool:
        self._spike = self.detector.check(loss, grad_norm)
        return self._spike is None

    def on_step_end(self, state: TrainState) -> None:
        spike, self._spike = self._spike, None
        if state.result.skipped:
            return
        if spike is None:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        state.spike_skips = self.total
        if state.rank0:
            print(f"step {state.step}: loss spike ({spike.describe()}), step skipped "
                  f"({self.in_a_row} in a row, {self.total} in all)", flush=True)
        if self.in_a_row >= self.cfg.max_in_a_row:
            last = tag_for(state.last_saved) if state.last_saved > 0 else "none"
            raise TrainingStopped(
                f"step {state.step}: {self.in_a_row} loss spikes in a row "
                f"(train.spike_skip.max_in_a_row={self.cfg.max_in_a_row}); stopping without "
                f"saving, last good checkpoint: {last}", SPIKE_EXIT_CODE)
