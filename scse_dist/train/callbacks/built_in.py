"""The built-in callbacks: each builds itself from the config section that enables it
(`Callback.from_config`), so the trainer names none. Their hook order is their priorities'
(callbacks.base); a new built-in is its module and its line here."""

from __future__ import annotations

from scse_dist.config import RunConfig
from scse_dist.train.callbacks.after_training import AfterTrainingEval
from scse_dist.train.callbacks.base import Callback
from scse_dist.train.callbacks.checkpointing import CheckpointCallback
from scse_dist.train.callbacks.diagnostics import LoopDiagnosticsCallback
from scse_dist.train.callbacks.downstream import DownstreamEvalCallback
from scse_dist.train.callbacks.export import ExportCallback
from scse_dist.train.callbacks.heldout_eval import HeldoutEvalCallback
from scse_dist.train.callbacks.metrics import MetricsCallback
from scse_dist.train.callbacks.nonfinite import NonFiniteCallback
from scse_dist.train.callbacks.preemption import PreemptionCallback
from scse_dist.train.callbacks.profiler import ProfilerCallback
from scse_dist.train.callbacks.samples import SampleCallback
from scse_dist.train.callbacks.spike import SpikeSkipCallback

BUILT_INS: tuple[type[Callback], ...] = (
    NonFiniteCallback, SpikeSkipCallback, LoopDiagnosticsCallback, MetricsCallback,
    HeldoutEvalCallback, SampleCallback, DownstreamEvalCallback, CheckpointCallback,
    PreemptionCallback, ExportCallback, AfterTrainingEval, ProfilerCallback)


def built_in_callbacks(cfg: RunConfig) -> list[Callback]:
    """The built-ins `cfg` enables, in their hook order."""
    return [c for cls in BUILT_INS if (c := cls.from_config(cfg)) is not None]
