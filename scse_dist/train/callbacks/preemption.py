"""Preemption: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) finish the step in flight, save it, exit 75.

The flag is installed before anything else in train(), so a signal during start-up is honoured at
the first step. A second Ctrl-C stops at once (exit 130) without saving: see PreemptionFlag.
"""

from __future__ import annotations

from typing import Optional

from scse_dist.checkpoint.tags import tag_for
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.faults import REQUEUE_EXIT_CODE, PreemptionFlag


class PreemptionCallback(Callback):
    priority = -200

    def __init__(self) -> None:
        self.flag = PreemptionFlag().install()

    def requested(self) -> bool:
        return self.flag.requested

    def on_step_end(self, state: TrainState) -> None:
        if state.result.stop:  # agreed across ranks in train_step; the checkpoint callback saves
            state.stop_reason = self.flag.signal_name or "a signal on another rank"

    def release(self, state: Optional[TrainState]) -> None:
        """At the end of train(), whatever happened. A preempted run keeps the handlers, so that a
        second SIGTERM cannot kill a rank still shutting down (scse-train then ignores them until
        exit; see cli.main)."""
        if state is None or state.stop_reason is None:
            self.flag.uninstall()

    def on_teardown(self, state: TrainState) -> None:
        if state.stop_reason is not None and state.rank0:
            print(f"preempted by {state.stop_reason}: saved {tag_for(state.last_saved)} after step "
                  f"{state.last_saved}; rerun to resume (exit status {REQUEUE_EXIT_CODE})",
                  flush=True)
