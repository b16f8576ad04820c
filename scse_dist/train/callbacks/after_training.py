"""eval.after_train: the held-out evaluation of the export, on rank 0 once the process group is
gone (no peer waits on it past a collective timeout); results in run_dir/eval/heldout.json."""

from __future__ import annotations

from scse_dist.checkpoint.tags import tag_for
from scse_dist.train.callbacks.base import Callback, TrainState


class AfterTrainingEval(Callback):
    priority = -400

    def after_shutdown(self, state: TrainState) -> None:
        if not (state.rank0 and state.cfg.eval.after_train):
            return
        from scse_dist.eval.export_eval import evaluate_export

        cfg = state.cfg
        state.summary["eval_path"] = evaluate_export(
            state.run_dir, "heldout", label=f"{cfg.name}@{tag_for(cfg.train.max_steps)}")
