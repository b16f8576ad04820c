"""The trainer's callback protocol: a `TrainState` every hook reads, and `Callback` with its hooks.

`train()` (scse_dist.train.loop) calls the hooks on every rank, for each callback by `priority`
(highest first; ties keep the order given): on_start, then per step before_update (gradients
complete, no update yet), allow_update (inside the update of a finite step), on_step_end (a hook
may set state.stop_reason to end the run); on_train_end at train.max_steps (the process group
still up), on_teardown at every orderly end, after_shutdown on finished runs once the process
group is gone. A hook that raises ends the run; collectives in a hook run on every rank alike.
The built-ins' priorities and what each hook may do: docs/callbacks.md, "The trainer: callbacks".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from scse_dist.config import RunConfig

if TYPE_CHECKING:  # annotations only: this module stays free of torch (config checks import it)
    from deepspeed import DeepSpeedEngine

    from scse_dist.checkpoint.storage import RunStorage
    from scse_dist.data.mixture import MixedStream
    from scse_dist.data.stream import TokenStream
    from scse_dist.data.tokenizer import Tokenizer
    from scse_dist.distributed import DistEnv
    from scse_dist.train.faults import FaultInjector, PreemptionFlag
    from scse_dist.train.metrics import MetricsLogger
    from scse_dist.train.step import StepResult


@dataclass
class TrainState:
    """What the trainer knows, shared by the callbacks. Set up by train(); hooks read it and may
    write the fields marked so."""

    cfg: RunConfig
    env: DistEnv
    run_dir: Path
    storage: RunStorage
    engine: DeepSpeedEngine  # engine.module is the LoopedLM
    stream: TokenStream | MixedStream  # the training stream (a mixture: data.mixture_paths)
    tokenizer: Tokenizer
    logger: MetricsLogger  # a no-op off rank 0
    faults: FaultInjector
    start_step: int
    step: int = 0  # optimizer steps done
    _result: Optional[StepResult] = field(default=None, repr=False)  # see `result`
    lr: float = 0.0  # the lr the last step used
    step_seconds: float = 0.0  # wall time of the last optimizer step (its data included)
    last_saved: int = -1  # step of the newest checkpoint of this run (-1: none yet)
    skipped_steps: int = 0  # non-finite steps skipped so far (written by the non-finite callback)
    spike_skips: Optional[int] = None  # spikes skipped so far (spike_skip on), else None
    stop_reason: Optional[str] = None  # set by a hook: the run ends after this step (preemption)
    preemption: Optional[PreemptionFlag] = None  # the trainer's signal flag (train() sets it)
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    # entries a hook adds to this step's metrics row (MetricsCallback logs them, then clears)
    metrics_extra: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # returned by train(); hooks add to it
    callbacks: list[Callback] = field(default_factory=list)  # in hook order (set by train())

    @property
    def result(self) -> StepResult:
        """The last step's StepResult: set before every on_step_end (RuntimeError before)."""
        if self._result is None:
            raise RuntimeError("TrainState.result: no step has run yet")
        return self._result

    @result.setter
    def result(self, value: StepResult) -> None:
        self._result = value

    @property
    def rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def max_steps(self) -> int:
        return self.cfg.train.max_steps

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        micro_batch = int(t.batch.micro_batch_size)  # resolved at start-up: never "auto" here
        return self.env.world_size * micro_batch * t.batch.grad_accum_steps * self.cfg.data.seq_len


class Callback:
    """Base class: every hook does nothing and there is no state; override what a concern needs.
    A train.callbacks entry builds `Class(Class.Config(**init_args))`, without Config `Class()`,
    and passes, by name, each section of the run config that the constructor has a parameter
    for (`train`, `model`, `eval`, ...). A Config may have a `check` of its fields against such
    sections, named the same way (ConfigError)."""

    priority: int = 0  # hook order: higher first; an entry sets its own
    Config: ClassVar[Optional[type]] = None  # the dataclass of its train.callbacks init_args

    def for_run(self) -> bool:
        """False: no work in this run (e.g. a cadence of 0), so the run leaves it out."""
        return True

    @property
    def state_key(self) -> str:
        """Where its state lives in a checkpoint: `module:Class` (train() numbers repeats)."""
        return f"{type(self).__module__}:{type(self).__qualname__}"

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to carry on: plain values (numbers, strings, lists, dicts), the same
        on every rank (rank 0's is the one saved)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state_dict() a checkpoint saved, before on_start of the resumed run (any world
        size; a callback after CheckpointCallback had its state saved before its on_step_end)."""

    def on_start(self, state: TrainState) -> None:
        pass

    def before_update(self, state: TrainState) -> None:
        pass

    def allow_update(self, state: TrainState, loss: float, grad_norm: float) -> bool:
        """Whether this step's update may be applied: asked once the global gradient norm
        before clipping is known, with the loss averaged over all ranks. False leaves the weights
        as they were on every rank, so the answer must come from these numbers and the callback's
        own state alone. Asked only when some callback overrides it."""
        return True

    def on_step_end(self, state: TrainState) -> None:
        pass

    def on_train_end(self, state: TrainState) -> None:
        pass

    def on_teardown(self, state: TrainState) -> None:
        pass

    def after_shutdown(self, state: TrainState) -> None:
        pass


class StreakCallback(Callback):
    """Counts steps of one kind (non-finite, spikes) in all and in a row; the counts are its
    state, so a streak goes on across a resume. `max_in_a_row` in a row end the run without
    saving (end_streak), the last good checkpoint kept."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.total = self.in_a_row = 0

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.in_a_row = int(state["total"]), int(state["in_a_row"])

    def end_streak(self, state: TrainState, what: str, entry: str, exit_code: int) -> None:
        """TrainingStopped(exit_code) once `what` came max_in_a_row times in a row."""
        if self.in_a_row < self.max_in_a_row:
            return
        from scse_dist.checkpoint.tags import tag_for  # torch-free module: config checks import it
        from scse_dist.train.faults import TrainingStopped

        last = tag_for(state.last_saved) if state.last_saved > 0 else "none"
        raise TrainingStopped(
            f"step {state.step}: {self.in_a_row} {what} in a row (train.callbacks.{entry}.init_args"
            f".max_in_a_row={self.max_in_a_row}); stopping without saving, last good checkpoint: "
            f"{last}", exit_code)


@dataclass
class Cadence:
    """A Config of a callback that acts every `every_steps` optimizer steps (0: off)."""

    every_steps: int = field(default=0, metadata={"ge": 0})


def reduce_totals(totals: list[dict], device: Any) -> list[dict]:
    """Per-depth additive totals of one rank -> their sums over every rank (one all-reduce)."""
    import torch

    from scse_dist.train.step import sum_over_ranks

    keys = [k for k in totals[0] if k != "depth"]
    values = torch.tensor([float(t[k]) for t in totals for k in keys], dtype=torch.float64,
                          device=device)
    summed = iter(sum_over_ranks(values).tolist())
    return [{"depth": t["depth"], **{k: next(summed) for k in keys}} for t in totals]


def every(n: int, step: int) -> bool:
    """Whether a cadence of `n` steps (0: off) falls on `step`."""
    return n > 0 and step % n == 0
