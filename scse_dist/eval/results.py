"""Evaluation results: one JSON file per (checkpoint, task), and a markdown table for the console.

JSON layout (the report reads these keys):
    {"task": "heldout", "checkpoint": "<label or path>", "run": cfg.name,
     "recurrence": cfg.model.recurrence, "residual": cfg.model.residual,
     "results": [{"depth": T, "loss": ..., "ppl": ..., "tokens": n}, ...],
     "config": <the full resolved RunConfig>, ...extra}
A diverged model's non-finite loss or ppl is written as null: the file stays strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from scse_dist.atomic import atomic_write_text
from scse_dist.cli_errors import InputError
from scse_dist.config import RunConfig, config_to_dict
from scse_dist.task_registry import TASKS


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def write_results(path: str | os.PathLike, task: str, checkpoint: str, cfg: RunConfig,
                  rows: list[dict], extra: dict[str, Any] | None = None) -> str:
    """Write the results JSON atomically. Returns the path."""
    payload: dict[str, Any] = {
        "task": task,
        "checkpoint": str(checkpoint),
        "run": cfg.name,
        "recurrence": cfg.model.recurrence,
        "residual": cfg.model.residual,
        "results": _finite_or_none(list(rows)),
        "config": config_to_dict(cfg),
    }
    clash = set(extra or {}) & set(payload)
    if clash:
        raise ValueError(f"write_results: extra keys {sorted(clash)} would overwrite documented "
                         "keys")
    payload.update(_finite_or_none(dict(extra or {})))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(payload, indent=2, allow_nan=False) + "\n")
    return str(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict], metrics: Sequence[str] = ("ppl", "loss")) -> str:
    """A fixed-width markdown table: one row per depth, one column per metric."""
    header = ["depth", *metrics]
    body = [[_cell(r["depth"]), *(_cell(r[m]) for m in metrics)]
            for r in sorted(rows, key=lambda r: r["depth"])]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(header), rule, *(fmt(line) for line in body)])


def read_results(path: Path) -> Optional[dict]:
    """A results JSON (scse_dist.eval.results) checked enough to report; None for other JSON."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a results JSON (not UTF-8 text: byte "
                         f"{exc.object[exc.start]:#04x} at offset {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not a results JSON ({exc.msg} at line {exc.lineno})") from None
    if not (isinstance(data, dict) and data.get("task") in TASKS and "results" in data):
        return None  # e.g. scheduled.json
    rows = data["results"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("depth"), int)
                                             for r in rows):
        raise InputError(f"{path}: field 'results' must be a list of objects with an integer "
                         "'depth' (rewrite it with scse-eval)")
    return data


def log_to_wandb(results: list[dict], wandb_cfg: Any, name: str, group: str, out_dir: str | Path,
                 images: Optional[dict[str, str]] = None) -> None:
    """The table's numbers (and any PNGs, by title) as one wandb run (job_type eval) in `group`."""
    import wandb

    from scse_dist.quiet import wandb_settings

    run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, group=group, name=name,
                     job_type="eval", mode=wandb_cfg.mode, dir=str(out_dir), reinit=True,
                     settings=wandb_settings())
    table = wandb.Table(columns=["run", "task", "metric", "depth", "value"])
    summary = {}
    for d in results:
        for r in d["results"]:
            for metric in TASKS[d["task"]].report:
                if r.get(metric) is not None:
                    table.add_data(d["_label"], d["task"], metric, r["depth"], r[metric])
                    summary[f"{d['task']}/{metric}@T{r['depth']}"] = r[metric]
    pictures = {f"eval/{title}": wandb.Image(str(path)) for title, path in (images or {}).items()}
    run.log({"eval/results": table, **summary, **pictures})
    run.finish()
