"""torch.profiler (train.callbacks.profiler, off by default) over a window of optimizer steps, a
Chrome trace and an ops' table per profiled rank in <run dir>/profile/ (docs/monitoring.md,
"Profiling"). Trace step k is optimizer step k; a step's span holds its hooks' work. A run that
ends inside the window writes what it recorded; one resumed past it profiles nothing and says so.
DeepSpeed's flops profiler (init_args.flops_step) is configured in the engine's config, on CUDA
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from scse_dist.run_dir import PROFILE_NAME
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.config import TrainConfig
from scse_dist.typed_yaml import ConfigError

if TYPE_CHECKING:  # torch in the hooks only: config checks import this module
    import torch
    from torch.profiler import ProfilerAction


def window_schedule(first_step: int, start: int, warmup: int, steps: int
                    ) -> Callable[[int], ProfilerAction]:
    """The profiler's action for optimizer step k from `first_step` (this process's first; the
    profiler's query for 0 at build time means it): warmup before `start` (as many steps as
    fit), record start .. start + steps - 1, save at the last."""
    from torch.profiler import ProfilerAction

    warmup = max(0, min(warmup, start - first_step))
    last = start + steps - 1

    def action(k: int) -> ProfilerAction:
        k = max(k, first_step)
        if k < start - warmup or k > last:
            return ProfilerAction.NONE
        if k < start:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if k == last else ProfilerAction.RECORD
    return action


class ProfilerCallback(Callback):
    @dataclass
    class Config:
        # torch.profiler over steps start_step .. last_step, after warmup_steps thrown away
        start_step: int = field(default=10, metadata={"ge": 1})
        steps: int = field(default=2, metadata={"ge": 1})
        warmup_steps: int = field(default=1, metadata={"ge": 0})
        ranks: list[int] = field(default_factory=lambda: [0])
        record_shapes: bool = False
        profile_memory: bool = False
        with_stack: bool = False
        # CUDA: DeepSpeed's flops profiler over this step (null: the one after the window; 0: off)
        flops_step: Optional[int] = field(default=None, metadata={"ge": 0, "note": "0: off"})

        def __post_init__(self) -> None:
            if not self.ranks or any(r < 0 for r in self.ranks):
                raise ConfigError(f"ranks: need a non-empty list of ranks >= 0, got {self.ranks}")

        def check(self, train: TrainConfig) -> None:
            if self.start_step > train.max_steps:
                raise ConfigError(f"init_args.start_step: {self.start_step} is past train."
                                  f"max_steps={train.max_steps}, so nothing would be "
                                  "profiled; lower it")

        @property
        def last_step(self) -> int:
            """The last step the trace records."""
            return self.start_step + self.steps - 1

        @property
        def flops_profile_step(self) -> int:
            """The optimizer step DeepSpeed's flops profiler measures (0: none)."""
            return self.last_step + 1 if self.flops_step is None else self.flops_step

    priority = -500  # last: a profiled step's span holds its row, evaluation and checkpoint too

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.profiler: Optional[torch.profiler.profile] = None
        self.recorded: list[int] = []  # optimizer steps inside the recording window so far
        self.written: list[Path] = []

    def on_start(self, state: TrainState) -> None:
        import torch
        from torch.profiler import ProfilerActivity

        p, rank = self.cfg, state.env.rank
        if not any(r < state.env.world_size for r in p.ranks):
            raise ConfigError(f"train.callbacks.profiler.init_args.ranks: none of {p.ranks} is a "
                              f"rank of this run (world size {state.env.world_size})")
        cuda = state.engine.device.type == "cuda"
        if state.rank0 and p.flops_profile_step and not cuda:
            print("profile: DeepSpeed's flops profiler runs on CUDA only; skipped on CPU",
                  flush=True)
        if rank not in p.ranks:
            return
        first = state.step + 1  # the first step this process runs
        if p.last_step < first:
            print(f"profile: steps {p.start_step}..{p.last_step} were done before this run "
                  f"resumed at step {state.step}: nothing profiled", flush=True)
            return
        self.dir = state.run_dir / PROFILE_NAME
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=window_schedule(first, p.start_step, p.warmup_steps, p.steps),
            on_trace_ready=self._save, record_shapes=p.record_shapes,
            profile_memory=p.profile_memory, with_stack=p.with_stack)
        self.profiler.step_num = first  # ProfilerStep#k in the trace is optimizer step k
        self.profiler.start()

    def on_step_end(self, state: TrainState) -> None:
        if self.profiler is None:
            return
        if self.cfg.start_step <= state.step <= self.cfg.last_step:
            self.recorded.append(state.step)
        if state.step >= min(self.cfg.last_step, state.max_steps) or state.stop_reason:
            self._stop()  # the window's or the run's last step (preempted): the trace is written
        else:
            self.profiler.step()

    def on_teardown(self, state: TrainState) -> None:
        self._stop()  # a run stopped by a hook inside the window: the steps recorded so far

    def _stop(self) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _save(self, profiler: Any) -> None:
        from torch.profiler import ProfilerActivity

        if not self.recorded:
            return
        name = f"rank{self.rank}.steps{self.recorded[0]}-{self.recorded[-1]}"
        trace = self.dir / f"{name}.pt.trace.json"
        profiler.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if ProfilerActivity.CUDA in profiler.activities \
            else "self_cpu_time_total"
        (self.dir / f"{name}.txt").write_text(
            profiler.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        self.written.append(trace)
        print(f"profile: steps {self.recorded[0]}..{self.recorded[-1]} of rank {self.rank} in "
              f"{trace} (open it in https://ui.perfetto.dev or chrome://tracing)", flush=True)
