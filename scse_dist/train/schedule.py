"""Learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay
(docs/training.md, "LR schedules").

`LRSchedule(step)` is the LR multiplier of 0-based optimizer step s: the warmup ramps 1/W, 2/W,
..., 1 over steps 0..W-1; every decay runs from its anchor `a` (the last step at the peak: W for
cosine and linear, max_steps - 1 - D for wsd) with progress p = (s - a) / (max_steps - 1 - a),
clamped to [0, 1]. It is a function of the config and the step only: a resumed or branched run
follows its own config's schedule from the step it resumes at (`ConfigLR`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from scse_dist.train.config import TrainConfig
from scse_dist.train.schedule_config import ScheduleConfig


@dataclass(frozen=True)
class LRSchedule:
    """LR multiplier for optimizer step s (module docstring)."""

    warmup_steps: int
    max_steps: int
    min_ratio: float
    kind: str = "cosine"
    decay_steps: int = 0  # wsd only: D
    decay_shape: str = "linear"  # wsd only

    @classmethod
    def from_config(cls, train: TrainConfig) -> "LRSchedule":
        s = train.schedule
        decay = s.wsd_decay_steps(train.max_steps) if s.kind == "wsd" else 0
        return cls(s.warmup_steps, train.max_steps, s.min_lr_ratio, s.kind, decay, s.decay_shape)

    @property
    def decay_anchor(self) -> float:
        """The last step at the peak, from which the decay's progress counts (inf: none)."""
        if self.kind == "constant":
            return math.inf
        if self.kind == "wsd":
            return self.max_steps - 1 - self.decay_steps
        return self.warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        anchor = self.decay_anchor
        if step <= anchor and self.kind in ("wsd", "constant"):  # the stable phase: exactly 1
            return 1.0
        span = max(1, self.max_steps - 1 - anchor)
        progress = min(1.0, (step - anchor) / span)
        shape = self.kind if self.kind in ("cosine", "linear") else self.decay_shape
        return self.min_ratio + (1.0 - self.min_ratio) * _decayed(shape, progress)


def _decayed(shape: str, progress: float) -> float:
    """1 at progress 0 down to 0 at progress 1."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


class ConfigLR(LambdaLR):
    """A LambdaLR whose state (what DeepSpeed saves in a checkpoint) is the step count only:
    torch's also saves its base LRs and the schedule's fields, which would replace this run's
    schedule with the checkpoint's. `load_state_dict` takes the step and applies the config's
    schedule there, so an unchanged config resumes bit for bit and a changed one takes effect."""

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict["_step_count"]
        self.apply()

    def lrs_at(self, step: int) -> list[float | torch.Tensor]:
        # LambdaLR.get_lr's expression, so an unchanged schedule gives the saved floats exactly
        return [base_lr * lmbda(step) for lmbda, base_lr in zip(self.lr_lambdas, self.base_lrs)]

    def apply(self) -> None:
        """Every param group's LR := the schedule's at the current step (after a checkpoint's
        optimizer state, which holds the LRs of the run that saved it, is loaded)."""
        lrs = self.lrs_at(self.last_epoch)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> ConfigLR:
    # deepspeed.initialize steps it once per optimizer step and saves its step count
    return ConfigLR(optimizer, LRSchedule.from_config(train))


def follow_config_schedule(scheduler: ConfigLR, train: TrainConfig,
                           saved: Optional[dict]) -> Optional[str]:
    """After a resume or branch: every group's LR from this run's schedule at the resumed step
    (the checkpoint's optimizer state holds the saving run's). Returns a line saying so when that
    LR differs from the one the checkpoint's own schedule (`saved`: the train section of its
    config, as plan_resume read it; None: none recorded) gives there; None when they agree (an
    unchanged config, a wsd run extended in its stable phase)."""
    scheduler.apply()
    if saved is None:
        return None
    # the fields the LR at a step depends on: the rates, max_steps and train.schedule; a field
    # the checkpoint lacks did not exist yet: its default is what that run did
    defaults = TrainConfig()
    rates = {name: saved.get("optimizer", {}).get(name, getattr(defaults.optimizer, name))
             for name in ("lr", "muon_lr")}
    before = dataclasses.replace(
        train, max_steps=saved.get("max_steps", defaults.max_steps),
        optimizer=dataclasses.replace(train.optimizer, **rates),
        schedule=ScheduleConfig(**{f.name: saved.get("schedule", {}).get(
            f.name, getattr(defaults.schedule, f.name))
            for f in dataclasses.fields(ScheduleConfig)}))
    step = scheduler.last_epoch
    old = before.optimizer.lr * LRSchedule.from_config(before)(step)
    new = scheduler.get_last_lr()[0]
    if old == new:
        return None
    return (f"train.schedule: step {step + 1} runs at lr {new:.4e} under this config's schedule "
            f"({describe(train)}); the checkpoint's ({describe(before)}) had {old:.4e}")


def describe(train: TrainConfig) -> str:
    """The schedule in a few words: 'wsd linear, decay 200 of 2000 steps, warmup 100'."""
    s = train.schedule
    shape = {"wsd": f"wsd {s.decay_shape}, decay {s.wsd_decay_steps(train.max_steps)} of"}.get(
        s.kind, s.kind + ",")
    return f"{shape} {train.max_steps} steps, warmup {s.warmup_steps}, lr {train.optimizer.lr:g}"
