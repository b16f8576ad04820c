"""A run directory's layout: the one place that names its files, reads its metrics and tells
whether an evaluation of it is complete.

    RUN/config.yaml        the resolved RunConfig (written before training starts)
    RUN/metrics.jsonl      one JSON object a line: training rows (no "kind"), and rows of a kind
                           ("eval", "sample") that callbacks write during training
    RUN/checkpoints/       DeepSpeed tags step-<k>/ and `latest`
    RUN/export/            the exported model: model.safetensors, config.yaml, the tokenizer
    RUN/tensorboard/       TensorBoard event files (tensorboard.enabled)
    RUN/profile/           profiler traces (the profiler callback)
    RUN/eval/<name>.json   a results JSON per task (a study's sweep run: validation.json), and
                           report.md, frontier.png, scheduled.json

No torch and nothing above the config layer is imported here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.jsonl"
CHECKPOINTS_NAME = "checkpoints"
EXPORT_NAME = "export"
EVAL_NAME = "eval"
TENSORBOARD_NAME = "tensorboard"  # event files (tensorboard.enabled; its log_dir's default)
PROFILE_NAME = "profile"  # profiler traces and the flops profiler's report (the profiler callback)
WEIGHTS_NAME = "model.safetensors"  # the export's weights (scse_dist.checkpoint.export)
# A study's sweep run is scored on lr.validation into eval/validation.json: not a task's result.
VALIDATION_NAME = "validation"
# What training leaves in a run dir (a fresh start over them is refused or moves them aside).
OUTPUT_NAMES = (CHECKPOINTS_NAME, METRICS_NAME, EXPORT_NAME, EVAL_NAME, TENSORBOARD_NAME,
                PROFILE_NAME)
# The kind of the rows the trainer's held-out evaluation writes (train.callbacks.heldout_eval).
EVAL_KIND = "eval"
# The key of a results JSON cut short by Ctrl-C: how far it got, {"done", "total", "unit"}.
PARTIAL_KEY = "partial"


def metric_lines(path: str | os.PathLike) -> list[tuple[str, Optional[dict]]]:
    """Every line of a metrics.jsonl with its row (None for a torn line: a run killed mid-write,
    or anything but a JSON object); [] without the file."""
    path = Path(path)
    if not path.is_file():
        return []
    out: list[tuple[str, Optional[dict]]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        out.append((line, row if isinstance(row, dict) else None))
    return out


def metric_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a metrics.jsonl in file order, torn lines skipped."""
    return [row for _, row in metric_lines(path) if row is not None]


def is_complete(results_path: str | os.PathLike) -> bool:
    """An evaluation is complete when its results JSON exists, reads, and is not marked partial
    (PARTIAL_KEY)."""
    try:
        data = json.loads(Path(results_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, unreadable, not UTF-8, not JSON
        return False
    return isinstance(data, dict) and PARTIAL_KEY not in data


class RunDir:
    """The paths of one run directory (see the module's docstring) and its metrics."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def config(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_NAME

    @property
    def export(self) -> Path:
        return self.path / EXPORT_NAME

    @property
    def eval(self) -> Path:
        return self.path / EVAL_NAME

    def results(self, name: str) -> Path:
        """RUN/eval/<name>.json: a task's results (or another evaluation's, e.g. validation)."""
        return self.eval / f"{name}.json"

    def exported(self) -> bool:
        """Training finished: the export's weights are there."""
        return (self.export / WEIGHTS_NAME).is_file()

    def evaluated(self, name: str) -> bool:
        return is_complete(self.results(name))

    def started(self) -> bool:
        """Training wrote something (a row, a checkpoint or an export)."""
        return self.metrics.is_file() or self.checkpoints.is_dir() or self.export.is_dir()

    def metric_rows(self) -> list[dict]:
        return metric_rows(self.metrics)

    def training_rows(self) -> list[dict]:
        """metrics.jsonl's training rows, in order (rows with a "kind" left out)."""
        return [row for row in self.metric_rows() if "kind" not in row]

    def rows_of(self, kind: str) -> list[dict]:
        """metrics.jsonl's rows of one kind ("eval", "sample"), in order."""
        return [row for row in self.metric_rows() if row.get("kind") == kind]
