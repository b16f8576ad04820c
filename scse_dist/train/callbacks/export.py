"""The export at the end of training: the final checkpoint consolidated to an fp32 model dir."""

from __future__ import annotations

from scse_dist.checkpoint.tags import export_final, tag_for
from scse_dist.distributed import barrier
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.faults import stopped_when_out_of_space


class ExportCallback(Callback):
    """run_dir/export (scse_dist.checkpoint.tags.export_final); the path in summary["export_dir"]
    on rank 0. After the checkpoint callback, whose on_train_end saves the final step."""

    priority = -300

    def on_train_end(self, state: TrainState) -> None:
        barrier()
        with stopped_when_out_of_space(state.last_saved):  # rerun: the export from that tag
            state.summary["export_dir"] = export_final(state.engine, state.cfg, state.run_dir,
                                                       tag_for(state.max_steps), state.storage,
                                                       state.faults)
