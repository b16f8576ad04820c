"""Held-out loss and downstream metrics against training step, from the rows the trainer writes
during training (RUN/metrics.jsonl, docs/monitoring.md): the heldout_eval callback's rows of kind
"eval" and the downstream callback's rows of kind "downstream" (keys `<task>_<metric>_T<depth>`,
downstream_key)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.figures import label, panels, save
from scse_dist.run_dir import EVAL_KIND, RunDir
from scse_dist.task_registry import TASKS

CURVE_NAME = "heldout_curve.png"
DOWNSTREAM_CURVE_NAME = "downstream_curve.png"
DOWNSTREAM_KIND = "downstream"
DOWNSTREAM_KEY = "{task}_{metric}_T{depth}"  # the trainer's heldout_loss_T4 has this form too


def eval_rows(run_dir: str | Path, kind: str = EVAL_KIND) -> list[dict]:
    """The run's rows of `kind` (evaluation: "eval", downstream tasks: "downstream") in file
    order."""
    return RunDir(run_dir).rows_of(kind)


def downstream_key(task: str, metric: str, depth: int) -> str:
    """The key of a downstream row's value: `hellaswag_acc_norm_T4`."""
    return DOWNSTREAM_KEY.format(task=task, metric=metric, depth=depth)


def _by_depth(rows: list[dict], task: str, metric: str) -> dict[int, list[tuple[int, float]]]:
    """{depth: [(step, the rows' `<task>_<metric>_T<depth>`), ...]} sorted by depth, then step."""
    key = re.compile("^" + re.escape(DOWNSTREAM_KEY.format(task=task, metric=metric, depth="@"))
                     .replace("@", r"(\d+)") + "$")
    curves: dict[int, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            match = key.match(name)
            if match:
                curves.setdefault(int(match.group(1)), []).append((int(row["step"]), value))
    return {d: sorted(points) for d, points in sorted(curves.items())}


def downstream_by_depth(rows: list[dict]) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{task: {depth: [(step, the task's headline metric), ...]}} from rows of kind downstream,
    tasks in registry order."""
    curves = {task: _by_depth(rows, task, record.headline) for task, record in TASKS.items()}
    return {task: by_depth for task, by_depth in curves.items() if by_depth}


def loss_by_depth(rows: list[dict]) -> dict[int, list[tuple[int, float]]]:
    """{depth: [(step, held-out loss), ...]} sorted by depth, then step."""
    return _by_depth(rows, "heldout", "loss")


def heldout_curve_plot(run_dirs: Sequence[str | Path], path: str | Path) -> Optional[str]:
    """One panel per run that has evaluation rows, one line per depth; None when none has."""
    runs = [(Path(r), loss_by_depth(eval_rows(r))) for r in run_dirs]
    runs = [(r, curves) for r, curves in runs if curves]
    if not runs:
        return None
    fig, axes = panels(1, len(runs), 4.5, 3.6)
    for ax, (run_dir, curves) in zip(axes[0], runs):
        for depth, points in curves.items():
            ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=f"T={depth}")
        label(ax, "training step", "held-out loss", run_dir.name)
    return save(fig, path)


def downstream_curve_plot(run_dirs: Sequence[str | Path], path: str | Path) -> Optional[str]:
    """One row of panels per run that has downstream rows, one panel per task (its headline
    metric against step), one line per depth; None when no run has such rows."""
    runs = [(Path(r), downstream_by_depth(eval_rows(r, DOWNSTREAM_KIND))) for r in run_dirs]
    runs = [(r, tasks) for r, tasks in runs if tasks]
    if not runs:
        return None
    fig, axes = panels(len(runs), max(len(tasks) for _, tasks in runs), 4.5, 3.6)
    for row, (run_dir, tasks) in zip(axes, runs):
        for ax, (task, curves) in zip(row, tasks.items()):
            for depth, points in curves.items():
                ax.plot([s for s, _ in points], [v for _, v in points], marker=".",
                        label=f"T={depth}")
            label(ax, "training step", TASKS[task].headline, f"{run_dir.name}: {task}")
        for ax in row[len(tasks):]:
            ax.set_visible(False)
    return save(fig, path)
