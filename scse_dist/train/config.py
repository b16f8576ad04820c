"""The `train:` section of a run config: its own fields, train.callbacks, and the sections each
beside its code (batch, engine, optimizer, ...). Torch-free, so `scse_dist.config` composes it
without loading the trainer (field meanings: docs/config.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from scse_dist.checkpoint.save_config import CheckpointConfig
from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.train.batch_config import BatchConfig
from scse_dist.train.depth_config import DepthSamplingConfig
from scse_dist.train.engine_config import EngineConfig
from scse_dist.train.loss_config import LossConfig
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule_config import ScheduleConfig
from scse_dist.typed_yaml import ConfigError


@dataclass
class CallbackSpec:
    """An entry of train.callbacks: a trainer callback, built-in or own (docs/training.md)."""

    class_path: str = ""  # "package.module:Class", imported when training starts (""; a built-in's)
    enabled: bool = True
    priority: Optional[int] = None  # null: the class's own
    init_args: dict[str, Any] = field(default_factory=dict)  # the fields of the class's Config


# The built-ins: train.callbacks' entries by default, each off-able, its settings its init_args.
BUILT_INS = "scse_dist.train.callbacks"
BUILT_IN_CALLBACKS = {
    "nonfinite": "nonfinite:NonFiniteCallback", "spike_skip": "spike:SpikeSkipCallback",
    "diagnostics": "diagnostics:LoopDiagnosticsCallback", "metrics": "metrics:MetricsCallback",
    "heldout_eval": "heldout_eval:HeldoutEvalCallback", "samples": "samples:SampleCallback",
    "downstream": "downstream:DownstreamEvalCallback",
    "checkpoint": "checkpointing:CheckpointCallback", "preemption": "preemption:PreemptionCallback",
    "export": "export:ExportCallback", "after_training": "after_training:AfterTrainingEval",
    "profiler": "profiler:ProfilerCallback"}
OFF_BY_DEFAULT = ("spike_skip", "profiler")


def built_in_entries() -> dict[str, CallbackSpec]:
    return {name: CallbackSpec(f"{BUILT_INS}.{path}", enabled=name not in OFF_BY_DEFAULT)
            for name, path in BUILT_IN_CALLBACKS.items()}


CALLBACK_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class TrainConfig:
    batch: BatchConfig = field(default_factory=BatchConfig)
    max_steps: int = field(default=200, metadata={"gt": 0})
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    start: StartConfig = field(default_factory=StartConfig)
    depth: DepthSamplingConfig = field(default_factory=DepthSamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    log_every: int = field(default=10, metadata={"gt": 0})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    # name -> entry: the built-ins (built_in_entries), then the user's; an entry naming a
    # built-in is laid over it (its init_args key by key)
    callbacks: dict[str, CallbackSpec] = field(default_factory=built_in_entries)

    def __post_init__(self) -> None:
        given, self.callbacks = self.callbacks, built_in_entries()
        for name, spec in given.items():
            base = self.callbacks.get(name)
            if base is not None and spec.class_path in ("", base.class_path):
                spec.class_path = base.class_path
                spec.init_args = {**base.init_args, **spec.init_args}
            self.callbacks[name] = spec

    def check(self) -> None:
        """Combinations no run can train with (one ConfigError naming the field), its sections'
        too; each field's bounds are declared on it (typed_yaml checks them)."""
        self.batch.check()
        self.depth.check()
        self.optimizer.check()
        self.schedule.check(self.max_steps)
        self.start.check()
        self._check_optimizer_zero()
        for name, spec in self.callbacks.items():
            if not CALLBACK_PATH.fullmatch(spec.class_path):
                raise ConfigError(f"train.callbacks.{name}.class_path: expected "
                                  f"'package.module:Class', got {spec.class_path!r}")

    def _check_optimizer_zero(self) -> None:
        """train.optimizer against the ZeRO stage."""
        kind, stage = self.optimizer.kind, self.engine.zero_stage
        if kind == "muon" and stage == 3:
            # DeepSpeed's ds_to_universal (resume at another world size) has no Muon state there
            raise ConfigError("train.engine.zero_stage: train.optimizer.kind: muon works at ZeRO "
                              "stage 0, 1 or 2, not 3; set train.engine.zero_stage: 2 (it "
                              "partitions gradients and optimizer state too) or use torch_adamw")
        if self.optimizer.update_clip and stage == 3:
            raise ConfigError("train.optimizer.update_clip: works at ZeRO stage 0, 1 or 2 (it "
                              "finds each parameter in the rank's flat partition), not 3")
