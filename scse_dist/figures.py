"""The PNG plumbing every report shares: matplotlib without a display, a row of panels, a
panel's labels, a figure written and closed. What a plot shows stays with its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def panels(rows: int, cols: int, width: float, height: float) -> tuple[Any, Any]:
    """(figure, axes[rows][cols]) of panels `width` x `height` inches each."""
    return pyplot().subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def label(ax: Any, xlabel: str, ylabel: Optional[str] = None, title: Optional[str] = None,
          legend_size: Optional[int] = 7) -> None:
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if legend_size:
        ax.legend(fontsize=legend_size)


def save(fig: Any, path: str | Path, dpi: int = 100) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return str(path)
