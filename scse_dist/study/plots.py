"""The study report's PNGs: the frontier against loop depth T and against FLOPs per token, with
interval bands, one line per variant; the loop diagnostics per variant after training; and the
loop diagnostics logged during training, one line per run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from scse_dist.figures import label, panels, save
from scse_dist.study.stats import Interval

# {panel title: {variant: [(x, Interval), ...]}}
Series = dict[str, dict[str, list[tuple[float, Interval]]]]


def frontier_plot(series: Series, path: str | Path, xlabel: str,
                  log_base: Optional[int] = 2) -> str:
    """One panel per task metric; each variant a line (mean over seeds) with its 95% band. A
    variant with one x (an untied model) is a point with an error bar."""
    fig, axes = panels(1, max(1, len(series)), 4.8, 3.8)
    for ax, (title, by_variant) in zip(axes[0], series.items()):
        for variant, points in by_variant.items():
            points = sorted(points, key=lambda p: p[0])
            xs, means = [x for x, _ in points], [iv.mean for _, iv in points]
            banded = [(x, iv) for x, iv in points if iv.low is not None]
            if len(points) == 1:
                iv = points[0][1]
                err = [[iv.mean - iv.low], [iv.high - iv.mean]] \
                    if iv.low is not None and iv.high is not None else None
                ax.errorbar(xs, means, yerr=err, marker="s", capsize=3, linestyle="none",
                            label=variant)
                continue
            (line,) = ax.plot(xs, means, marker="o", label=variant)
            if banded:
                ax.fill_between([x for x, _ in banded], [iv.low for _, iv in banded],
                                [iv.high for _, iv in banded], color=line.get_color(), alpha=0.2)
        if log_base:
            ax.set_xscale("log", base=log_base)
        label(ax, xlabel, title)
    return save(fig, path)


def diagnose_plot(by_variant: dict[str, dict[str, list[tuple[int, float]]]],
                  path: str | Path) -> str:
    """One panel per variant: deviation, motion and forcing-bias norm (means over seeds) vs T."""
    fig, axes = panels(1, max(1, len(by_variant)), 4.2, 3.6)
    for ax, (variant, norms) in zip(axes[0], by_variant.items()):
        for name, points in norms.items():
            points = sorted((t, v) for t, v in points if v > 0)  # log axis: a norm of 0 drops
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the norms span decades when a loop converges or collapses
        label(ax, "loop depth T", title=variant)
    return save(fig, path)


# the training log's loop diagnostics per run (docs/loop-diagnostics.md): metric -> label, y scale
TRAINING_DIAGNOSTICS = {"diag/D_kept": ("|D_T| / |D_0|", "log"),
                        "diag/anchor_over_scale": ("R / rho", "linear"),
                        "diag/loop_gain": ("loss(T=1) - loss(T) [nats]", "linear")}


def training_diagnostics_plot(by_variant: dict[str, dict[str, dict[str, list[tuple[int, float]]]]],
                              collapsed: set[str], path: str | Path) -> str:
    """A row per variant, a column per TRAINING_DIAGNOSTICS metric, a line per run against the
    step; runs in `collapsed` (labels) dashed, so a collapsing seed stands out."""
    cols = list(TRAINING_DIAGNOSTICS)
    fig, axes = panels(max(1, len(by_variant)), len(cols), 4.2, 2.8)
    for axes_row, (variant, runs) in zip(axes, by_variant.items()):
        for i, (ax, metric) in enumerate(zip(axes_row, cols)):
            ylabel, scale = TRAINING_DIAGNOSTICS[metric]
            for run, series in runs.items():
                points = [(s, v) for s, v in series.get(metric, []) if scale != "log" or v > 0]
                if points:
                    ax.plot([s for s, _ in points], [v for _, v in points],
                            linestyle="--" if run in collapsed else "-", label=run)
            ax.set_yscale(scale)
            label(ax, "training step", title=f"{variant}: {ylabel}",
                  legend_size=6 if i == 0 else None)
    return save(fig, path, dpi=90)
