"""Training metrics: peak FLOP/s for MFU, a console line, run_dir/metrics.jsonl, wandb and
TensorBoard (rank 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from scse_dist.atomic import NoSpaceError, atomic_write_text, no_space
from scse_dist.run_dir import RunDir, metric_lines
from scse_dist.train.metrics_config import WandbConfig

PEAK_FLOPS_ENV = "SCSE_PEAK_FLOPS"
# Dense bf16 tensor-core peaks (FLOP/s), matched as substrings of torch.cuda.get_device_name().
# Order matters: more specific names first.
CUDA_PEAK_BF16: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


def peak_flops(device: torch.device) -> Optional[float]:
    """Per-device peak FLOP/s: $SCSE_PEAK_FLOPS, else the bf16 table on CUDA, else None (CPU, an
    unknown GPU): MFU is then left out rather than guessed (a matmul timed at start-up measures
    what other jobs leave free, not a peak)."""
    if os.environ.get(PEAK_FLOPS_ENV):
        return float(os.environ[PEAK_FLOPS_ENV])
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in CUDA_PEAK_BF16 if key in name), None)
    return None


def peak_memory(device: torch.device) -> dict[str, float]:
    """{"peak_mem_gib": the most memory torch allocated on `device` so far} on CUDA; {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}


# Loop diagnostics shown on the console line (all of them go to metrics.jsonl and wandb).
CONSOLE_DIAGNOSTICS = (("diag/D_kept", "D_T/D_0"), ("diag/anchor_over_scale", "R/rho"),
                       ("diag/loop_gain", "loop gain"))


def format_line(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']:>6d}"]
    if "loss" in row:  # a training row; a diagnostics-only row has just step and diag/
        parts += [f"loss {row['loss']:.4f}"]
        parts += [f"z_loss {row['z_loss']:.3g}"] if "z_loss" in row else []  # train.loss.z_loss
        # train.loss.depth: the loss at its short depth
        parts += [f"loss_short {row['loss_short']:.4f}"] if "loss_short" in row else []
        parts += [f"lr {row['lr']:.3e}", f"T {row['depth']:>2d}"]
        # train.depth.curriculum: the mean T the step drew around
        parts += [f"T mean {row['depth_mean']:.2f}"] if "depth_mean" in row else []
        parts += [f"tok/s {row['tokens_per_s']:,.0f}", f"step {row['step_time_s'] * 1000:.0f} ms"]
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.2f}%")
    if row.get("peak_mem_gib") is not None:
        parts.append(f"peak mem {row['peak_mem_gib']:.1f} GiB")
    parts += [f"{label} {row[key]:.3g}" for key, label in CONSOLE_DIAGNOSTICS if key in row]
    return " | ".join(parts)


def cut_metrics(path: str | Path, step: int) -> int:
    """Drop the rows of `path` past `step` (and a torn last line), atomically; returns how many
    (at a resume from step N a dead run's rows past N would come twice)."""
    lines = metric_lines(path)
    kept = [line for line, row in lines if row is not None and int(row.get("step", 0)) <= step]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return len(lines) - len(kept)


class MetricsLogger:
    """Writes each logged row to the console, run_dir/metrics.jsonl (flushed), wandb and, given a
    `tensorboard_dir`, TensorBoard (`resumed_step`: the checkpoint step resumed, 0: a fresh
    start). Rank 0's; the others pass enabled=False and every call is a no-op."""

    def __init__(self, run_dir: str, enabled: bool, wandb_cfg: WandbConfig, run_name: str,
                 config_dict: dict[str, Any], tensorboard_dir: Optional[str | Path] = None,
                 resumed_step: int = 0) -> None:
        self.enabled = enabled
        self._file: Optional[int] = None  # metrics.jsonl's descriptor, appending
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file.
        self._path = RunDir(run_dir).metrics
        self._file = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        if tensorboard_dir is not None:
            from scse_dist.train.tensorboard import TensorBoardSink

            self._tensorboard = TensorBoardSink(tensorboard_dir, resumed_step)
            print(f"tensorboard: {tensorboard_dir} (tensorboard --logdir {tensorboard_dir})",
                  flush=True)
        if wandb_cfg.enabled and wandb_cfg.mode != "disabled":
            import wandb

            from scse_dist.quiet import wandb_settings

            self._wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity,
                                     group=wandb_cfg.group, name=run_name, mode=wandb_cfg.mode,
                                     dir=run_dir, config=config_dict, settings=wandb_settings())

    def log(self, row: dict[str, Any], console_tail: str = "") -> None:
        """A training row: the console line (with `console_tail`, e.g. elapsed time and ETA, which
        only the console shows), then metrics.jsonl and wandb."""
        if not self.enabled:
            return
        print(format_line(row) + console_tail, flush=True)
        self.write(row)

    def write(self, row: dict[str, Any]) -> None:
        """Any row (evaluation, samples: they carry a "kind") to metrics.jsonl, wandb and
        TensorBoard only."""
        if not self.enabled:
            return
        assert self._file is not None  # opened when enabled
        self._append((json.dumps(row) + "\n").encode())
        if self._wandb is not None:
            self._wandb.log(self._for_wandb(row), step=row["step"])
        if self._tensorboard is not None:
            self._tensorboard.write(row)

    def _append(self, line: bytes) -> None:
        """`line` whole at the end of metrics.jsonl, or (no space for it: NoSpaceError) not at
        all: a part written is cut off again."""
        assert self._file is not None
        size = os.fstat(self._file).st_size
        try:
            with no_space(self._path):
                view = memoryview(line)
                while view:  # a write may take part of it: a full disk fails the next one
                    view = view[os.write(self._file, view):]
        except NoSpaceError:
            os.ftruncate(self._file, size)
            raise

    @staticmethod
    def _for_wandb(row: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in row.items() if k != "kind"}
        if "samples" in out:  # generations during training: one table per step
            import wandb

            out["samples"] = wandb.Table(columns=["prompt", "text"],
                                         data=[[s["prompt"], s["text"]] for s in out["samples"]])
        return out

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
        for sink, end in ((self._wandb, "finish"), (self._tensorboard, "close")):
            if sink is not None:
                getattr(sink, end)()
        self._file = self._wandb = self._tensorboard = None
