"""The trainer's callback protocol: a `TrainState` every hook reads, and `Callback` with its hooks.

`train()` (scse_dist.train.loop) calls the hooks in this order, each on every rank, for each
callback in its list order:

    on_start(state)          the engine is built and resumed; state.step is the resumed step
    before_update(state)     at each step's update boundary: the last backward is done, the
                             optimizer step not yet (the full gradients are there); state.step
                             is still the steps done before this one
    on_step_end(state)       after each optimizer step; state.step is the steps done, state.result
                             the step's StepResult. A hook may set state.stop_reason to end the run
                             (the loop breaks after this step's hooks).
    on_train_end(state)      the run reached train.max_steps (not on preemption): the process group
                             is still up, so collectives (final checkpoint, export) belong here
    on_teardown(state)       every orderly end (finished, preempted, TrainingStopped): close files
    after_shutdown(state)    finished runs, after the process group is gone: rank-0-only work that
                             no peer should wait on (evaluation of the export, uploads)

A hook that raises ends the run; hooks that run collectives must do so on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from scse_dist.config import RunConfig


@dataclass
class TrainState:
    """What the trainer knows, shared by the callbacks. Set up by train(); hooks read it and may
    write the fields marked so."""

    cfg: RunConfig
    env: Any  # scse_dist.distributed.DistEnv
    run_dir: Path
    storage: Any  # scse_dist.checkpoint.storage.RunStorage
    engine: Any  # the DeepSpeed engine; engine.module is the LoopedLM
    stream: Any  # the training TokenStream
    tokenizer: Any
    logger: Any  # scse_dist.train.metrics.MetricsLogger (a no-op off rank 0)
    faults: Any  # scse_dist.train.faults.FaultInjector
    start_step: int
    step: int = 0  # optimizer steps done
    result: Any = None  # the last step's StepResult
    lr: float = 0.0  # the lr the last step used
    step_seconds: float = 0.0  # wall time of the last optimizer step (its data included)
    last_saved: int = -1  # step of the newest checkpoint of this run (-1: none yet)
    skipped_steps: int = 0  # non-finite steps skipped so far (written by the non-finite callback)
    stop_reason: Optional[str] = None  # set by a hook: the run ends after this step (preemption)
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    # Entries a hook adds to this step's metrics row (MetricsCallback logs them with its row, or
    # in a row of their own on a step it does not log) and then clears: loop diagnostics.
    metrics_extra: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # returned by train(); hooks add to it

    @property
    def rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def max_steps(self) -> int:
        return self.cfg.train.max_steps

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return self.env.world_size * t.micro_batch_size * t.grad_accum_steps * self.cfg.data.seq_len


class Callback:
    """Base class: every hook does nothing. Subclass and override the hooks a concern needs."""

    def on_start(self, state: TrainState) -> None:
        pass

    def before_update(self, state: TrainState) -> None:
        pass

    def on_step_end(self, state: TrainState) -> None:
        pass

    def on_train_end(self, state: TrainState) -> None:
        pass

    def on_teardown(self, state: TrainState) -> None:
        pass

    def after_shutdown(self, state: TrainState) -> None:
        pass


def every(n: int, step: int) -> bool:
    """Whether a cadence of `n` steps (0: off) falls on `step`."""
    return n > 0 and step % n == 0
