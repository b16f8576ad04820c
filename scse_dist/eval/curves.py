"""Held-out loss against training step, from the evaluation rows the trainer writes during
training (eval.every_steps; rows of kind "eval" in RUN/metrics.jsonl, docs/training.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.figures import label, panels, save

CURVE_NAME = "heldout_curve.png"
_LOSS_KEY = re.compile(r"^heldout_loss_T(\d+)$")


def metrics_rows(path: str | Path) -> list[dict]:
    """Every row of a metrics.jsonl in file order ([] without the file); a torn line (a run
    killed mid-write) is skipped. Training rows have no "kind"; evaluation and sample rows have."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def eval_rows(run_dir: str | Path) -> list[dict]:
    """The run's evaluation rows in file order."""
    return [row for row in metrics_rows(Path(run_dir) / "metrics.jsonl") if row.get("kind") == "eval"]


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
