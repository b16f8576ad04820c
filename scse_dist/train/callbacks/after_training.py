"""eval.after_train: the held-out evaluation of the export, on rank 0 once the process group is
gone (no peer waits on it past a collective timeout); results in run_dir/eval/heldout.json."""

from __future__ import annotations

from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.checkpoint.tags import tag_for


class AfterTrainingEval(Callback):
    priority = -400

    def after_shutdown(self, state: TrainState) -> None:
        if not (state.rank0 and state.cfg.eval.after_train):
            return
        import torch

        from scse_dist.eval.cli import run_heldout_eval
        from scse_dist.checkpoint.export import load_exported_model

        cfg = state.cfg
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, export_cfg = load_exported_model(state.summary["export_dir"], device=device)
        out_path = str(state.run_dir / "eval" / "heldout.json")
        run_heldout_eval(model, export_cfg, cfg.data.path, cfg.eval.depths, out_path,
                         checkpoint_label=f"{cfg.name}@{tag_for(cfg.train.max_steps)}",
                         max_batches=cfg.eval.max_batches)
        state.summary["eval_path"] = out_path
