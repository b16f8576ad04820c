"""Reports: a training run's evaluation JSONs -> markdown table, quality-frontier PNG, wandb.

    scse-report runs/scse runs/additive runs/untied --out reports/main   # compare several runs
    scse-report --study runs/my-study      # a study's seeds aggregated (scse_dist.study.report)

A run's results are `RUN/eval/*.json` (scse_dist.eval.task_run.run_task). The table has one row
per (run, task, metric) and one column per depth; the plot draws each task's headline metric
against depth (log scale), one line per run (an untied model: a point at its fixed depth). Runs
trained with the heldout_eval or downstream callback on also get heldout_curve.png or
downstream_curve.png, against training step (scse_dist.eval.curves).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

from scse_dist.atomic import output_dir
from scse_dist.eval.curves import (
    CURVE_NAME,
    DOWNSTREAM_CURVE_NAME,
    downstream_curve_plot,
    heldout_curve_plot,
)
from scse_dist.eval.results import log_to_wandb, read_results
from scse_dist.figures import label, panels, save
from scse_dist.run_dir import PARTIAL_KEY, RunDir
from scse_dist.task_registry import TASKS

REPORT_NAME, PLOT_NAME = "report.md", "frontier.png"


def collect(run_dirs: Sequence[str | Path]) -> list[dict]:
    """Every results JSON of every run, in run order then task order."""
    results, used = [], set()
    for run_dir in run_dirs:
        found = []
        for f in sorted(RunDir(run_dir).eval.glob("*.json")):
            data = read_results(f)
            if data is not None:
                found.append(data)
        if not found:
            raise FileNotFoundError(f"{run_dir}: no evaluation results in {RunDir(run_dir).eval}")
        label = f"{found[0].get('run', Path(run_dir).name)} ({found[0].get('recurrence')})"
        if label in used:  # two runs of one name: tell them apart by directory
            label += f" [{run_dir}]"
        used.add(label)
        for data in found:
            data["_label"] = label
        results += sorted(found, key=lambda d: list(TASKS).index(d["task"]))
    return results


def _fmt(value: Any) -> str:
    if value is None:
        return "nan"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e4 or (value and abs(value) < 1e-3) \
            else f"{value:.4f}"
    return str(value)


def markdown_table(results: list[dict]) -> str:
    """| run | task | metric | T=1 | T=2 | ... | over the union of all depths ('' where absent)."""
    depths = sorted({r["depth"] for d in results for r in d["results"]})
    lines = ["| run | task | metric | " + " | ".join(f"T={t}" for t in depths) + " |",
             "|---|---|---|" + "---:|" * len(depths)]
    for d in results:
        by_depth = {r["depth"]: r for r in d["results"]}
        for metric in TASKS[d["task"]].report:
            cells = [_fmt(by_depth[t].get(metric)) if t in by_depth else "" for t in depths]
            lines.append(f"| {d['_label']} | {_task_cell(d)} | {metric} | " + " | ".join(cells)
                         + " |")
    return "\n".join(lines)


def _task_cell(data: dict) -> str:
    """The task, and for results cut short by Ctrl-C (scse-eval's "partial") how far they got."""
    part = data.get(PARTIAL_KEY)
    if not isinstance(part, dict):
        return data["task"]
    total = f"/{part.get('total')}" if part.get("total") else ""
    return f"{data['task']} (partial: {part.get('done')}{total} {part.get('unit')})"


def frontier_plot(results: list[dict], path: str | Path) -> str:
    """One panel per task (its headline metric against depth), one line per run."""
    tasks = [t for t in TASKS if any(d["task"] == t for d in results)]
    fig, axes = panels(1, len(tasks), 4.5, 3.6)
    for ax, task in zip(axes[0], tasks):
        metric = TASKS[task].headline
        for d in (d for d in results if d["task"] == task):
            points = sorted((r["depth"], r.get(metric)) for r in d["results"])
            points = [(t, v) for t, v in points if v is not None and math.isfinite(v)]
            ax.plot([t for t, _ in points], [v for _, v in points], marker="o", label=d["_label"])
        ax.set_xscale("log", base=2)
        label(ax, "loop depth T", metric, task)
    return save(fig, path)


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path, wandb_cfg: Any = None,
                 wandb_name: str = "eval", wandb_group: Optional[str] = None
                 ) -> dict[str, Optional[str]]:
    """Collect, then write out_dir/report.md and out_dir/frontier.png (and wandb if enabled).
    The files are written beside out_dir and moved in together (scse_dist.atomic.output_dir)."""
    results = collect(run_dirs)
    out = Path(out_dir)
    table = markdown_table(results)
    with output_dir(str(out), lambda u: (Path(u) / REPORT_NAME).is_file(), REPORT_NAME) as tmp:
        plot = frontier_plot(results, Path(tmp) / PLOT_NAME)
        curve = heldout_curve_plot(run_dirs, Path(tmp) / CURVE_NAME)
        downstream = downstream_curve_plot(run_dirs, Path(tmp) / DOWNSTREAM_CURVE_NAME)
        (Path(tmp) / REPORT_NAME).write_text(
            "# Evaluation report\n\nRuns: " + ", ".join(str(r) for r in run_dirs) + "\n\n"
            + table + f"\n\n![quality frontier]({PLOT_NAME})\n"
            + (f"\n![held-out loss during training]({CURVE_NAME})\n" if curve else "")
            + (f"\n![downstream tasks during training]({DOWNSTREAM_CURVE_NAME})\n"
               if downstream else ""))
    plot, curve = str(out / PLOT_NAME), curve and str(out / CURVE_NAME)
    downstream = downstream and str(out / DOWNSTREAM_CURVE_NAME)
    print(table)
    if wandb_cfg is not None and wandb_cfg.enabled and wandb_cfg.mode != "disabled":
        log_to_wandb(results, wandb_cfg, wandb_name, wandb_group or wandb_name, out)
    return {"report": str(out / REPORT_NAME), "plot": plot, "curve": curve,
            "downstream_curve": downstream}


def report_run(run_dir: str | Path) -> dict[str, Optional[str]]:
    """The report of one training run, into RUN/eval/, logged to the run's wandb group."""
    from scse_dist.config import load_saved_config

    run = RunDir(run_dir)
    cfg = load_saved_config(run.config)  # as saved: its paths are not the config file's
    return write_report([run_dir], run.eval, cfg.wandb, wandb_name=f"{cfg.name}-eval",
                        wandb_group=cfg.wandb.group or cfg.name)
