"""Checkpoints during training: every train.checkpoint.every steps, at the last step, and at the
step in flight when the run is preempted, each with every callback's state; the remote upload
finished at the end."""

from __future__ import annotations

import time

from scse_dist.checkpoint.tags import save_checkpoint, tag_for
from scse_dist.config import config_to_dict
from scse_dist.train.callbacks.assembly import callback_states
from scse_dist.train.callbacks.base import Callback, TrainState, every
from scse_dist.train.faults import stopped_when_out_of_space


class CheckpointCallback(Callback):
    """Saves (all ranks; scse_dist.checkpoint.tags.save_checkpoint) and owns the storage's end:
    `storage.finish()` once, at the end of training or at the teardown of a stopped run."""

    priority = -100

    def __init__(self) -> None:
        self.finished = False

    def on_step_end(self, state: TrainState) -> None:
        step = state.step
        if every(state.cfg.train.checkpoint.every, step) or step == state.max_steps \
                or state.result.stop:
            self.save(state, step)

    def on_train_end(self, state: TrainState) -> None:
        if state.last_saved != state.max_steps:  # resumed at max_steps already, or zero steps
            self.save(state, state.max_steps)
        # also before the export: it may read other nodes' shards from the remote
        state.summary["not_uploaded"] = self.finish(state)

    def on_teardown(self, state: TrainState) -> None:
        if not self.finished:  # preempted or stopped: the last good checkpoint reaches the remote
            self.finish(state)

    def finish(self, state: TrainState) -> list[str]:
        self.finished = True
        return state.storage.finish()

    @staticmethod
    def save(state: TrainState, step: int) -> None:
        start = time.perf_counter()
        with stopped_when_out_of_space(state.last_saved):  # the previous tag stays `latest`
            save_checkpoint(state.engine, state.run_dir, step, state.stream,
                            config_to_dict(state.cfg), state.cfg.train.checkpoint.keep,
                            state.faults, state.storage, callback_states(state.callbacks))
        state.last_saved = step
        if state.rank0:
            print(f"saved checkpoint {tag_for(step)} ({time.perf_counter() - start:.1f} s)",
                  flush=True)
