"""The study report's PNGs: the frontier against loop depth T and against FLOPs per token, with
interval bands, one line per variant; the loop diagnostics per variant after training; and the
loop diagnostics logged during training, one line per run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from scse_dist.study.stats import Interval

# {panel title: {variant: [(x, Interval), ...]}}
Series = dict[str, dict[str, list[tuple[float, Interval]]]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def frontier_plot(series: Series, path: str | Path, xlabel: str, log_base: Optional[int] = 2) -> str:
    """One panel per task metric; each variant a line (mean over seeds) with its 95% band. A
    variant with one x (an untied model) is a point with an error bar."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(series)), figsize=(4.8 * max(1, len(series)), 3.8),
                             squeeze=False)
    for ax, (title, by_variant) in zip(axes[0], series.items()):
        for variant, points in by_variant.items():
            points = sorted(points, key=lambda p: p[0])
            xs, means = [x for x, _ in points], [iv.mean for _, iv in points]
            banded = [(x, iv) for x, iv in points if iv.low is not None]
            if len(points) == 1:
                iv = points[0][1]
                err = [[iv.mean - iv.low], [iv.high - iv.mean]] if iv.low is not None else None
                ax.errorbar(xs, means, yerr=err, marker="s", capsize=3, linestyle="none", label=variant)
                continue
            (line,) = ax.plot(xs, means, marker="o", label=variant)
            if banded:
                ax.fill_between([x for x, _ in banded], [iv.low for _, iv in banded],
                                [iv.high for _, iv in banded], color=line.get_color(), alpha=0.2)
        if log_base:
            ax.set_xscale("log", base=log_base)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def diagnose_plot(by_variant: dict[str, dict[str, list[tuple[int, float]]]], path: str | Path) -> str:
    """One panel per variant: deviation, motion and forcing-bias norm (means over seeds) vs T."""
    plt = _pyplot()
    n = max(1, len(by_variant))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (variant, norms) in zip(axes[0], by_variant.items()):
        for name, points in norms.items():
            points = sorted((t, v) for t, v in points if v > 0)  # log axis: a collapsed norm of 0 drops
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the norms span decades when a loop converges or collapses
        ax.set_xlabel("loop depth T")
        ax.set_title(variant)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


# The training log's loop diagnostics drawn per run (docs/loop-diagnostics.md): the deviation
# kept over the loop, the anchor's norm over the core's output scale, and the loop's gain.
TRAINING_DIAGNOSTICS = {"diag/D_kept": ("|D_T| / |D_0|", "log"),
                        "diag/anchor_over_scale": ("R / rho", "linear"),
                        "diag/loop_gain": ("loss(T=1) - loss(T) [nats]", "linear")}


def training_diagnostics_plot(by_variant: dict[str, dict[str, dict[str, list[tuple[int, float]]]]],
                              collapsed: set[str], path: str | Path) -> str:
    """A row per variant, a column per TRAINING_DIAGNOSTICS metric, a line per run against the
    training step; runs in `collapsed` (their labels) dashed, so a collapsing seed stands out
    beside the healthy ones."""
    plt = _pyplot()
    cols = list(TRAINING_DIAGNOSTICS)
    rows = max(1, len(by_variant))
    fig, axes = plt.subplots(rows, len(cols), figsize=(4.2 * len(cols), 2.8 * rows), squeeze=False)
    for axes_row, (variant, runs) in zip(axes, by_variant.items()):
        for ax, metric in zip(axes_row, cols):
            ylabel, scale = TRAINING_DIAGNOSTICS[metric]
            for label, series in runs.items():
                points = [(s, v) for s, v in series.get(metric, []) if scale != "log" or v > 0]
                if points:
                    ax.plot([s for s, _ in points], [v for _, v in points],
                            linestyle="--" if label in collapsed else "-", label=label)
            ax.set_yscale(scale)
            ax.set_title(f"{variant}: {ylabel}", fontsize=9)
            ax.set_xlabel("training step")
            ax.grid(True, alpha=0.3)
        axes_row[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
