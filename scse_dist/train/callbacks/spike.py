"""Loss spikes (train.callbacks.spike_skip, off by default): the update of a spike is refused
(allow_update), the skips counted, said on rank 0 and logged (`spike_skips`), and too many in a
row end the run. The windows and counts are its state, so a resumed run needs no second warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from scse_dist.train.callbacks.base import StreakCallback, TrainState
from scse_dist.train.config import TrainConfig
from scse_dist.train.spike import Spike, SpikeDetector
from scse_dist.typed_yaml import ConfigError


class SpikeSkipCallback(StreakCallback):
    """`max_in_a_row` refused steps in a row raise TrainingStopped (exit 4), leaving the last
    good checkpoint as it was. Before the metrics callback, which logs the count; a non-finite
    step (the non-finite callback's) neither adds to nor ends a streak."""

    @dataclass
    class Config:
        """A step whose loss or gradient norm is more than k standard deviations above its
        running mean over `window` applied steps is not applied (scse_dist.train.spike)."""

        metric: Literal["loss", "grad_norm", "both"] = "both"
        k: float = field(default=6.0, metadata={"gt": 0, "finite": True})
        window: int = field(default=128, metadata={
            "ge": 2, "note": "a standard deviation needs two values"})
        warmup: int = 20  # applied steps before any step can be skipped
        # skipped spikes in a row that end the run (exit status 4)
        max_in_a_row: int = field(default=5, metadata={"ge": 1})

        def __post_init__(self) -> None:
            if not 2 <= self.warmup <= self.window:
                raise ConfigError(f"warmup: must lie in [2, window={self.window}], got "
                                  f"{self.warmup}")

        def check(self, train: TrainConfig) -> None:
            stage = train.engine.zero_stage
            if train.optimizer.kind == "muon" and stage in (1, 2):
                # ZeRO-1/2 commit Muon's momentum in their step, before the update a skip withholds
                raise ConfigError(f"not with train.optimizer.kind: muon at train.engine.zero_stage "
                                  f"{stage} (ZeRO-1/2 advance Muon's momentum even on a skipped "
                                  "step); use ZeRO stage 0 or torch_adamw")

    priority = 450

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.max_in_a_row)
        self.cfg = cfg
        self.detector = SpikeDetector(cfg)
        self._spike: Optional[Spike] = None  # this step's, between allow_update and on_step_end

    def state_dict(self) -> dict[str, Any]:
        return {"stats": self.detector.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["stats"])
        super().load_state_dict(state)

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
        from scse_dist.train.faults import SPIKE_EXIT_CODE

        self.end_streak(state, "loss spikes", "spike_skip", SPIKE_EXIT_CODE)
