"""Evaluate a run's export: the one function the trainer (after training), the launcher's
evaluation jobs and a study call. The export's own config gives the settings and the file the
task reads; the results go to RUN/eval/<name>.json, marked partial after a Ctrl-C (so
run_dir.is_complete() is False for it and the next call evaluates again).
"""

from __future__ import annotations

import os
from typing import Optional

from scse_dist.run_dir import RunDir
from scse_dist.task_registry import TASKS, data_path


def evaluate_export(run_dir: str | os.PathLike, task: str, *, data: Optional[str] = None,
                    at_model_depth: bool = False, depths: Optional[list[int]] = None,
                    name: Optional[str] = None, label: Optional[str] = None) -> str:
    """Evaluate RUN/export on `task` into RUN/eval/<name or task>.json; returns that path.
    data: default its eval.* file, else data.path; at_model_depth: at model.depth alone instead
    of eval.depths; depths: these instead of either; label: the results' "checkpoint" (default
    "<run name>@export")."""
    import torch

    from scse_dist.checkpoint.loading import load_model
    from scse_dist.eval.task_run import run_task

    run = RunDir(run_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = load_model(run.export, device=device)
    if depths is None:
        depths = [cfg.model.depth] if at_model_depth else cfg.eval.depths
    out = str(run.results(name or task))
    record = TASKS[task]
    stride = getattr(cfg.eval.settings(task), "stride", 0)  # wikitext's (0: seq_len // 2)
    run_task(task, model, cfg, data or data_path(record, cfg), depths, out,
             checkpoint_label=label or f"{cfg.name}@export", stride=stride or None,
             max_batches=cfg.eval.max_batches if record.heldout else 0)
    return out
