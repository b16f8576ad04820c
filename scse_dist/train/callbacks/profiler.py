"""profile.enabled: torch.profiler over a window of optimizer steps, a Chrome trace and an ops'
table per profiled rank in <run dir>/profile/ (docs/monitoring.md, "Profiling"). Trace step k is
optimizer step k; a step's span holds its hooks' work. A run that ends inside the window writes
what it recorded; one resumed past it profiles nothing and says so. DeepSpeed's flops profiler
(profile.flops_step) is configured in the engine's config, on CUDA only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from scse_dist.config import ConfigError, ProfileConfig
from scse_dist.run_dir import PROFILE_NAME
from scse_dist.train.callbacks.base import Callback, TrainState


def window_schedule(first_step: int, start: int, warmup: int, steps: int
                    ) -> Callable[[int], ProfilerAction]:
    """The profiler's action for optimizer step k from `first_step` (this process's first; the
    profiler's query for 0 at build time means it): warmup before `start` (as many steps as
    fit), record start .. start + steps - 1, save at the last."""
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
    priority = -500  # last: a profiled step's span holds its row, evaluation and checkpoint too
    config_key = "profile"

    def __init__(self, cfg: ProfileConfig) -> None:
        self.cfg = cfg
        self.profiler: Optional[torch.profiler.profile] = None
        self.recorded: list[int] = []  # optimizer steps inside the recording window so far
        self.written: list[Path] = []

    def on_start(self, state: TrainState) -> None:
        p, rank = self.cfg, state.env.rank
        if not any(r < state.env.world_size for r in p.ranks):
            raise ConfigError(f"profile.ranks: none of {p.ranks} is a rank of this run (world "
                              f"size {state.env.world_size})")
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
