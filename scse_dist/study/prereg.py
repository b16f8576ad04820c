"""A study's pre-registration (spec `preregistration:`): the primary comparison, its metric and
depth, and the decision rule, declared before the runs; the report prints it first, with the
rule applied, then the secondary comparisons, labelled so.

    preregistration:
      primary: {pair: [scse-deeploop, additive-preln], task: wikitext, metric: word_ppl, depth: 48}
    (task: any quality task, `validation` included: the study's validation text)
      secondary: [{pair: [...], task: lambada, metric: accuracy, depth: 48}, ...]
      note: free text (why this pair; what a win would mean)

The rule is fixed: the 95% paired t interval of A - B over the seeds both have, at that depth,
must exclude zero; its sign (and the metric's direction) says which is better.
"""

from __future__ import annotations

from typing import Any, Optional

from scse_dist.study.stats import Interval
from scse_dist.task_registry import TASKS
from scse_dist.typed_yaml import ConfigError

RULE = ("the 95% paired t interval of A - B over the seeds both have, at the declared depth, "
        "must exclude zero; otherwise the comparison is not resolved")


def higher_is_better(task: str, metric: str) -> bool:
    return metric in TASKS[task].higher_is_better


def _comparison(body: Any, variants: list[str], where: str) -> dict:
    if not isinstance(body, dict) or set(body) != {"pair", "task", "metric", "depth"}:
        raise ConfigError(f"{where}: expected {{pair: [A, B], task: ..., metric: ..., depth: T}}, "
                          f"got {body!r}")
    pair = body["pair"]
    if not isinstance(pair, list) or len(pair) != 2 or any(v not in variants for v in pair):
        raise ConfigError(f"{where}.pair: two variants of the study, got {pair!r}")
    task, metric, depth = body["task"], body["metric"], body["depth"]
    if task not in TASKS or TASKS[task].diagnostic:
        quality = ", ".join(n for n, t in TASKS.items() if not t.diagnostic)
        raise ConfigError(f"{where}.task: one of {quality}, got {task!r}")
    if metric not in TASKS[task].metrics:
        raise ConfigError(f"{where}.metric: {metric!r} is not a metric of {task} "
                          f"({', '.join(TASKS[task].metrics)})")
    if type(depth) is not int or depth < 1:
        raise ConfigError(f"{where}.depth: a loop depth >= 1, got {depth!r}")
    return {"pair": [str(v) for v in pair], "task": task, "metric": metric, "depth": depth}


def parse_preregistration(body: Any, variants: list[str]) -> dict[str, Any]:
    """The checked section ({} when the spec has none); ConfigError naming the field."""
    if body is None:
        return {}
    where = "preregistration"
    if not isinstance(body, dict) or "primary" not in body or \
            set(body) - {"primary", "secondary", "note"}:
        raise ConfigError(f"{where}: expected {{primary: ..., secondary: [...], note: ...}}, "
                          f"got {body!r}")
    secondary = body.get("secondary") or []
    if not isinstance(secondary, list):
        raise ConfigError(f"{where}.secondary: a list of comparisons, got {secondary!r}")
    return {"primary": _comparison(body["primary"], variants, f"{where}.primary"),
            "secondary": [_comparison(c, variants, f"{where}.secondary[{i}]")
                          for i, c in enumerate(secondary)],
            "note": str(body.get("note") or "")}


def comparisons(prereg: dict) -> list[tuple[str, dict]]:
    """('primary' | 'secondary', comparison), the primary first."""
    if not prereg:
        return []
    return [("primary", prereg["primary"])] + [("secondary", c) for c in prereg["secondary"]]


def decision(c: dict, diff: Optional[Interval]) -> str:
    """The rule applied to one comparison's paired interval at its depth."""
    a, b = c["pair"]
    if diff is None:
        return "no result: no seed has both runs evaluated at this depth"
    if diff.low is None or diff.high is None:
        return f"not resolved: {diff.n} seed in common (an interval needs 2)"
    if not diff.excludes_zero():
        return f"not resolved at {diff.n} seeds (the interval contains 0)"
    better = (diff.mean > 0) == higher_is_better(c["task"], c["metric"])
    return f"{a if better else b} is better ({a} - {b} excludes 0 at {diff.n} seeds)"


def markdown(prereg: dict, diffs: dict[tuple, Optional[Interval]]) -> list[str]:
    """The report's first section: what was declared, and the rule applied. `diffs`: (A, B,
    task, metric, depth) -> the paired interval of A - B (None: no seed in common)."""
    if not prereg:
        return []
    lines = ["## Pre-registration (declared in the spec before the runs)", "",
             f"Decision rule: {RULE}.", ""]
    if prereg.get("note"):
        lines += [prereg["note"], ""]
    lines += ["| | A - B | metric | T | A - B (95% interval) | decision |",
              "|---|---|---|---:|---|---|"]
    for role, c in comparisons(prereg):
        a, b = c["pair"]
        iv = diffs.get((a, b, c["task"], c["metric"], c["depth"]))
        shown = "" if iv is None else f"{iv.mean:+.4g}" + (
            "" if iv.low is None or iv.high is None else f" [{iv.low:+.4g}, {iv.high:+.4g}]")
        label = "**primary**" if role == "primary" else "secondary"
        lines.append(f"| {label} | {a} - {b} | {c['task']} {c['metric']} | {c['depth']} | "
                     f"{shown} | {decision(c, iv)} |")
    return lines + ["", "Secondary comparisons are reported, not decided on.", ""]
