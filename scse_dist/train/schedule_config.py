"""train.schedule: the LR schedule's section of a run config (scse_dist.train.schedule runs it).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = field(default=20, metadata={"ge": 0})
    min_lr_ratio: float = field(default=0.1, metadata={"ge": 0, "le": 1})
    decay_fraction: float = field(default=0.1, metadata={"gt": 0, "le": 1})
    decay_steps: Optional[int] = field(default=None,
                                       metadata={"ge": 1, "note": "null: decay_fraction"})
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"

    def check(self, max_steps: int) -> None:
        """What no schedule of `max_steps` steps can run (one ConfigError naming the field)."""
        if self.kind != "wsd":
            return
        decay = self.wsd_decay_steps(max_steps)
        if decay > max_steps - self.warmup_steps:
            named = "decay_steps" if self.decay_steps is not None else "decay_fraction"
            raise ConfigError(f"train.schedule.{named}: the wsd decay of {decay} steps overlaps "
                              f"the warmup of {self.warmup_steps} in train.max_steps={max_steps}; "
                              f"it may take at most {max_steps - self.warmup_steps}")

    def wsd_decay_steps(self, max_steps: int) -> int:
        """D, the steps of the wsd decay: decay_steps when set, else round(decay_fraction *
        max_steps) (Python's round: half to even), at least 1."""
        if self.decay_steps is not None:
            return self.decay_steps
        return max(1, round(self.decay_fraction * max_steps))
