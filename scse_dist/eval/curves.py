"""Held-out loss against training step, from the evaluation rows the trainer writes during
training (eval.every_steps; rows of kind "eval" in RUN/metrics.jsonl, docs/training.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.figures import label, panels, save
from scse_dist.run_dir import EVAL_KIND, RunDir

CURVE_NAME = "heldout_curve.png"
_LOSS_KEY = re.compile(r"^heldout_loss_T(\d+)$")


def eval_rows(run_dir: str | Path) -> list[dict]:
    """The run's evaluation rows in file order."""
    return RunDir(run_dir).rows_of(EVAL_KIND)


def loss_by_depth(rows: list[dict]) -> dict[int, list[tuple[int, float]]]:
    """{depth: [(step, held-out loss), ...]} sorted by depth, then step."""
    curves: dict[int, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            match = _LOSS_KEY.match(key)
            if match:
                curves.setdefault(int(match.group(1)), []).append((int(row["step"]), value))
    return {d: sorted(points) for d, points in sorted(curves.items())}


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
