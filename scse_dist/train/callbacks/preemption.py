"""Preemption: SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) finish the step in flight, save it, exit 75
(the flag is scse_dist.train.faults.PreemptionFlag, installed first in train())."""

from __future__ import annotations

from scse_dist.checkpoint.tags import tag_for
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.faults import REQUEUE_EXIT_CODE


class PreemptionCallback(Callback):
    """Ends the run after a step that train_step agreed to stop (state.result.stop), naming the
    signal of the trainer's flag (state.preemption), and says how to resume."""

    priority = -200

    def on_step_end(self, state: TrainState) -> None:
        if state.result.stop:  # agreed across ranks in train_step; the checkpoint callback saves
            flag = state.preemption
            state.stop_reason = (flag.signal_name if flag else None) or "a signal on another rank"

    def on_teardown(self, state: TrainState) -> None:
        if state.stop_reason is not None and state.rank0:
            print(f"preempted by {state.stop_reason}: saved {tag_for(state.last_saved)} after step "
                  f"{state.last_saved}; rerun to resume (exit status {REQUEUE_EXIT_CODE})",
                  flush=True)
