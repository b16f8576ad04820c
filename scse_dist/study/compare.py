"""A study's variants compared over seeds: per (variant, task, metric) and depth the t interval
of the metric (aggregate), the paired difference of two variants with seeds matched (paired), and
what that difference says (verdict). The report (scse_dist.study.report) shows them."""

from __future__ import annotations

from scse_dist.study.collect import StudyRun, finite
from scse_dist.study.stats import Interval, t_interval

# (variant, task, metric) -> depth -> Interval
Table = dict[tuple[str, str, str], dict[int, Interval]]


def values_by_depth(runs: list[StudyRun], task: str, metric: str) -> dict[int, dict[int, float]]:
    """depth -> seed -> the task's metric (finite values only)."""
    out: dict[int, dict[int, float]] = {}
    for run in runs:
        for depth, row in run.results.get(task, {}).items():
            value = finite(row.get(metric))
            if value is not None:
                out.setdefault(depth, {})[run.seed] = value
    return out


def aggregate(runs: list[StudyRun], variants: list[str], metrics: dict[str, list[str]]) -> Table:
    """Per (variant, task, metric) and depth: the t interval of the metric over seeds."""
    table: Table = {}
    for variant in variants:
        mine = [r for r in runs if r.variant == variant]
        for task, names in metrics.items():
            for metric in names:
                by_depth = values_by_depth(mine, task, metric)
                if by_depth:
                    table[(variant, task, metric)] = {d: t_interval(list(v.values()))
                                                      for d, v in sorted(by_depth.items())}
    return table


def paired(runs: list[StudyRun], a: str, b: str, task: str, metric: str) -> dict[int, Interval]:
    """depth -> t interval of (A - B) over the seeds both variants have at that depth."""
    va = values_by_depth([r for r in runs if r.variant == a], task, metric)
    vb = values_by_depth([r for r in runs if r.variant == b], task, metric)
    out = {}
    for depth in sorted(set(va) & set(vb)):
        seeds = sorted(set(va[depth]) & set(vb[depth]))
        if seeds:
            out[depth] = t_interval([va[depth][s] - vb[depth][s] for s in seeds])
    return out


def verdict(diffs: dict[int, Interval], higher_is_better: bool) -> str:
    """'better at all depths', 'better at depths 4, 8', 'worse at ...', 'no difference' (all 0),
    or 'not resolved at n seeds' when every interval contains 0 (or there is none)."""
    if not diffs:
        return "no common depths"
    if all(iv.mean == 0 and not iv.std for iv in diffs.values()):
        n = min(iv.n for iv in diffs.values())
        return f"no difference (equal at every depth in all {n} seed{'s' if n != 1 else ''})"
    sign = 1 if higher_is_better else -1
    better = [d for d, iv in diffs.items() if iv.excludes_zero() and sign * iv.mean > 0]
    worse = [d for d, iv in diffs.items() if iv.excludes_zero() and sign * iv.mean < 0]
    n = min(iv.n for iv in diffs.values())
    if not better and not worse:
        return f"not resolved at {n} seed{'s' if n != 1 else ''}"
    parts = []
    for word, depths in (("better", better), ("worse", worse)):
        if len(depths) == len(diffs):
            parts.append(f"{word} at all depths")
        elif depths:
            parts.append(f"{word} at depths {', '.join(map(str, depths))}")
    return "; ".join(parts)
