"""Loss-spike statistics (train.callbacks.spike_skip): running mean and standard deviation of the
loss and the global gradient norm over a window of applied steps, and whether a step's values are
a spike.

No torch, no collectives: every rank is handed the same numbers and so decides alike. A refused
step stays out of the window, so a run of spikes cannot widen the statistics until it passes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

METRICS = {"loss": ("loss",), "grad_norm": ("grad_norm",), "both": ("loss", "grad_norm")}


class RunningStats:
    """Mean and sample standard deviation (n - 1) of the last `window` values added."""

    def __init__(self, window: int, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=window)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        self.values.append(float(value))

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        n = len(self.values)
        if n < 2:
            return math.nan
        mean = self.mean
        return math.sqrt(math.fsum((v - mean) ** 2 for v in self.values) / (n - 1))


@dataclass(frozen=True)
class Spike:
    """Why a step was refused: its `metric` at `value`, against the window's mean and std."""

    metric: str
    value: float
    mean: float
    std: float
    k: float

    def describe(self) -> str:
        return (f"{self.metric} {self.value:.4g} > mean {self.mean:.4g} + {self.k:g} x std "
                f"{self.std:.3g}")


class SpikeDetector:
    """One window of RunningStats per watched metric; `check` decides and then updates them."""

    def __init__(self, cfg: Any) -> None:  # callbacks.spike.SpikeSkipCallback.Config
        self.cfg = cfg
        self.stats = {name: RunningStats(cfg.window) for name in METRICS[cfg.metric]}

    def check(self, loss: float, grad_norm: float) -> Optional[Spike]:
        """The spike `loss` or `grad_norm` is, or None; a step that is not one joins the window.
        No metric can refuse before its window holds cfg.warmup values."""
        values = {"loss": float(loss), "grad_norm": float(grad_norm)}
        for name, stats in self.stats.items():
            if len(stats) < self.cfg.warmup:
                continue
            mean, std = stats.mean, stats.std
            if values[name] > mean + self.cfg.k * std:
                return Spike(name, values[name], mean, std, self.cfg.k)
        for name, stats in self.stats.items():
            stats.add(values[name])
        return None

    def state_dict(self) -> dict[str, Any]:
        return {name: list(stats.values) for name, stats in self.stats.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Saved windows back; a resume with a smaller window keeps their newest values, a metric
        that was not watched before starts empty (its own warm-up)."""
        for name in self.stats:
            self.stats[name] = RunningStats(self.cfg.window, state.get(name, ()))
