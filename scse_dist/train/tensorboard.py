"""TensorBoard beside metrics.jsonl and wandb: every row the MetricsLogger writes, as scalars.

Tags (docs/monitoring.md, "TensorBoard"): a training row's keys under `train/`, keys that name a
group keep it (diag/D_kept), a row of kind K under `K/`; values that are not numbers are left
out; a samples row's generations become a markdown table under `sample/text`. A resumed run
marks its new event file with a restart event at step N + 1 (purge_step), as metrics.jsonl is
cut there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from scse_dist.run_dir import TENSORBOARD_NAME
from scse_dist.train.metrics_config import TensorBoardConfig
from scse_dist.typed_yaml import ConfigError

NOT_INSTALLED = ("tensorboard.enabled: the tensorboard package is not installed; "
                 "pip install 'scse-dist[tensorboard]' (or tensorboard), or set "
                 "tensorboard.enabled: false")


def check_tensorboard(tensorboard: TensorBoardConfig) -> None:
    """ConfigError (one line) when the run asks for TensorBoard and the package is missing;
    imports nothing, so scse-train can say it before torch is loaded."""
    if tensorboard.enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(NOT_INSTALLED)


def tensorboard_log_dir(tensorboard: TensorBoardConfig, run_dir: str | Path) -> Optional[Path]:
    """Where the run's event files go; None when TensorBoard is off."""
    if not tensorboard.enabled:
        return None
    return Path(tensorboard.log_dir) if tensorboard.log_dir else Path(run_dir) / TENSORBOARD_NAME


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers by TensorBoard tag (see the module docstring)."""
    kind = row.get("kind")
    group = "train" if kind is None else str(kind)
    out = {}
    for key, value in row.items():
        if key not in ("step", "kind") and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            out[key if "/" in key else f"{group}/{key}"] = float(value)
    return out


def samples_markdown(samples: list[dict[str, str]]) -> str:
    """Generated samples as a markdown table (TensorBoard's text plugin renders markdown)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")
    lines = ["| prompt | text |", "|---|---|"]
    lines += [f"| {cell(s['prompt'])} | {cell(s['text'])} |" for s in samples]
    return "\n".join(lines)


class TensorBoardSink:
    """Rank 0's event writer. `resumed_step`: the checkpoint step this run starts after (0: a
    fresh start, whose restart event at step 1 hides a dead first attempt's points too)."""

    def __init__(self, directory: str | Path, resumed_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # train() called without the CLI's check
            raise ConfigError(NOT_INSTALLED) from None
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.directory), purge_step=resumed_step + 1)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for tag, value in scalars(row).items():  # NaN and Inf too, as metrics.jsonl has them
            self._writer.add_scalar(tag, value, step)
        if row.get("samples"):  # a samples row (kind "sample"): the text tag sample/text
            self._writer.add_text(f"{row.get('kind', 'sample')}/text",
                                  samples_markdown(row["samples"]), step)
        self._writer.flush()  # per row, like metrics.jsonl: a killed run loses nothing

    def close(self) -> None:
        self._writer.close()
