"""The `train:` section of a run config and the `wandb:`, `tensorboard:` and `profile:` sections.

Torch-free, so `scse_dist.config` composes it without loading the trainer. Each section's
`check()` is its one validation (field meanings: docs/config.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from scse_dist.checkpoint.save_config import CheckpointConfig
from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.model.config import ConfigError
from scse_dist.train.batch_config import BatchConfig
from scse_dist.train.engine_config import EngineConfig
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule_config import ScheduleConfig


@dataclass
class DepthCurriculumConfig:
    """train.depth.curriculum: the mean training depth ramps from `start` to model.depth over the
    first `fraction` of train.max_steps, `linear` or `1-sqrt` (scse_dist.train.depth)."""

    shape: Literal["none", "linear", "1-sqrt"] = "none"
    start: float = 1.0
    fraction: float = 0.25

    def check(self) -> None:
        if self.shape not in ("none", "linear", "1-sqrt"):
            raise ConfigError(f"train.depth.curriculum.shape: expected none, linear or 1-sqrt, "
                              f"got {self.shape!r}")
        if not 1 <= self.start < float("inf"):  # also rejects NaN
            raise ConfigError(f"train.depth.curriculum.start: must be >= 1, got {self.start}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"train.depth.curriculum.fraction: must be > 0 and <= 1, got "
                              f"{self.fraction}")


@dataclass
class DepthSamplingConfig:
    # fixed: T = model.depth; uniform: U{min, max} (max 0: 2*model.depth); poisson_lognormal
    kind: Literal["fixed", "uniform", "poisson_lognormal"] = "fixed"
    min: int = 2
    max: int = 0
    sigma: float = 0.5
    # Backpropagate through only the last k loop steps (0: all of them).
    backprop_steps: int = 0
    curriculum: DepthCurriculumConfig = field(default_factory=DepthCurriculumConfig)

    def check(self) -> None:
        self.curriculum.check()
        if self.min <= 0:
            raise ConfigError(f"train.depth.min: must be > 0, got {self.min}")
        if self.backprop_steps < 0:
            raise ConfigError(f"train.depth.backprop_steps: must be >= 0, got "
                              f"{self.backprop_steps}")
        if self.kind == "uniform" and self.max and self.max < self.min:
            raise ConfigError(f"train.depth.max: {self.max} is below train.depth.min={self.min}")
        if self.sigma <= 0:
            raise ConfigError(f"train.depth.sigma: must be > 0, got {self.sigma}")


@dataclass
class SpikeSkipConfig:
    """train.spike_skip: a step whose loss or gradient norm is more than k standard deviations
    above its running mean over `window` applied steps is not applied (scse_dist.train.spike)."""

    enabled: bool = False
    metric: Literal["loss", "grad_norm", "both"] = "both"
    k: float = 6.0
    window: int = 128
    warmup: int = 20  # applied steps before any step can be skipped
    max_in_a_row: int = 5  # skipped spikes in a row that end the run (exit status 4)

    def check(self) -> None:
        if not 0.0 < self.k < float("inf"):  # also rejects NaN
            raise ConfigError(f"train.spike_skip.k: must be a finite number > 0, got {self.k}")
        if self.window < 2:
            raise ConfigError(f"train.spike_skip.window: must be >= 2 (a standard deviation "
                              f"needs two values), got {self.window}")
        if not 2 <= self.warmup <= self.window:
            raise ConfigError(f"train.spike_skip.warmup: must lie in [2, train.spike_skip.window="
                              f"{self.window}], got {self.warmup}")
        if self.max_in_a_row < 1:
            raise ConfigError(f"train.spike_skip.max_in_a_row: must be >= 1, got "
                              f"{self.max_in_a_row}")


@dataclass
class DepthLossConfig:
    """train.loss.depth two_depths: the loss at loop depth `short`, read out from the same forward,
    joins the objective with `weight` (no term when the step's T <= short)."""

    kind: Literal["off", "two_depths"] = "off"
    weight: float = 0.5
    short: int = 2

    def check(self) -> None:
        if self.kind == "off":
            return
        if self.short < 1:
            raise ConfigError(f"train.loss.depth.short: must be >= 1, got {self.short}")
        if not 0 < self.weight < float("inf"):  # also rejects NaN
            raise ConfigError(f"train.loss.depth.weight: must be a finite weight > 0, got "
                              f"{self.weight}")


@dataclass
class LossConfig:
    """train.loss: terms added to the cross-entropy at the step's depth (which is logged)."""

    z_loss: float = 0.0
    depth: DepthLossConfig = field(default_factory=DepthLossConfig)

    def check(self) -> None:
        if not self.z_loss >= 0 or self.z_loss == float("inf"):  # also rejects NaN
            raise ConfigError(f"train.loss.z_loss: must be a finite weight >= 0, got {self.z_loss}")
        self.depth.check()


def largest_trained_depth(sampling: DepthSamplingConfig, mean_depth: int) -> int:
    """The deepest T training draws: uniform's max (2*mean when 0), poisson_lognormal's max, or
    2*mean when it is unbounded (its tail past that is rare), fixed's mean."""
    if sampling.kind == "fixed":
        return mean_depth
    return max(sampling.max or 2 * mean_depth, sampling.min)


@dataclass
class CallbackSpec:
    """One entry of train.callbacks: a trainer callback of the user's own (docs/training.md)."""

    class_path: str  # "package.module:Class", imported when training starts, not when read
    priority: Optional[int] = None  # null: the class's own
    init_args: dict[str, Any] = field(default_factory=dict)


CALLBACK_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class TrainConfig:
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_steps: int = 200
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    start: StartConfig = field(default_factory=StartConfig)
    depth: DepthSamplingConfig = field(default_factory=DepthSamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    log_every: int = 10
    diagnostics_every: Optional[int] = None  # loop diagnostics; null: log_every; 0: off
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    max_nonfinite_steps: int = 5  # non-finite (skipped) steps in a row that stop the run: exit 3
    spike_skip: SpikeSkipConfig = field(default_factory=SpikeSkipConfig)
    callbacks: list[CallbackSpec] = field(default_factory=list)

    def check(self) -> None:
        """Values no run can train with (one ConfigError naming the field), train.depth's too."""
        for name in ("max_steps", "log_every", "max_nonfinite_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: must be > 0, got {getattr(self, name)}")
        if self.diagnostics_every is not None and self.diagnostics_every < 0:
            raise ConfigError(f"train.diagnostics_every: must be >= 0, got "
                              f"{self.diagnostics_every}")
        self.batch.check()
        self.checkpoint.check()
        self.depth.check()
        self.spike_skip.check()
        self.loss.check()
        self.optimizer.check()
        self.schedule.check(self.max_steps)
        self.start.check()
        self.engine.check()
        self._check_optimizer_zero()
        for i, spec in enumerate(self.callbacks):
            if not CALLBACK_PATH.fullmatch(spec.class_path):
                raise ConfigError(f"train.callbacks[{i}].class_path: expected "
                                  f"'package.module:Class', got {spec.class_path!r}")

    def _check_optimizer_zero(self) -> None:
        """train.optimizer against the ZeRO stage and spike skipping."""
        kind, stage = self.optimizer.kind, self.engine.zero_stage
        if kind == "muon" and self.spike_skip.enabled and stage in (1, 2):
            # ZeRO-1/2 commit Muon's momentum inside their step, before the update a skip withholds
            raise ConfigError("train.spike_skip.enabled: not with train.optimizer.kind: muon at "
                              f"train.engine.zero_stage {stage} (ZeRO-1/2 advance Muon's "
                              "momentum even on a skipped step); use ZeRO stage 0 or torch_adamw")
        if kind == "muon" and stage == 3:
            # DeepSpeed's ds_to_universal (resume at another world size) has no Muon state there
            raise ConfigError("train.engine.zero_stage: train.optimizer.kind: muon works at ZeRO "
                              "stage 0, 1 or 2, not 3; set train.engine.zero_stage: 2 (it "
                              "partitions gradients and optimizer state too) or use torch_adamw")
        if self.optimizer.update_clip and stage == 3:
            raise ConfigError("train.optimizer.update_clip: works at ZeRO stage 0, 1 or 2 (it "
                              "finds each parameter in the rank's flat partition), not 3")


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "scse-dist"
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # every metrics.jsonl row as TensorBoard scalars (rank 0)
    log_dir: Optional[str] = None

    def check(self) -> None:
        if self.log_dir is not None and ("://" in self.log_dir or not self.log_dir.strip()):
            raise ConfigError(f"tensorboard.log_dir: a local directory, or null for <run dir>/"
                              f"tensorboard; got {self.log_dir!r}")


@dataclass
class ProfileConfig:
    # torch.profiler over steps start_step .. last_step, after warmup_steps thrown away
    enabled: bool = False
    start_step: int = 10
    steps: int = 2
    warmup_steps: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    # CUDA: DeepSpeed's flops profiler over this step (null: the one after the window; 0: off)
    flops_step: Optional[int] = None

    def check(self) -> None:
        for name in ("start_step", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"profile.{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"profile.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not self.ranks or any(r < 0 for r in self.ranks):
            raise ConfigError(f"profile.ranks: need a non-empty list of ranks >= 0, got "
                              f"{self.ranks}")
        if self.flops_step is not None and self.flops_step < 0:
            raise ConfigError(f"profile.flops_step: must be >= 0 (0: off), got {self.flops_step}")

    @property
    def last_step(self) -> int:
        """The last step the trace records."""
        return self.start_step + self.steps - 1

    @property
    def flops_profile_step(self) -> int:
        """The optimizer step DeepSpeed's flops profiler measures (0: none)."""
        return self.last_step + 1 if self.flops_step is None else self.flops_step
