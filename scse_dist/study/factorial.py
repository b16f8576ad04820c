"""A study read as a two-level factorial (spec report.factorial: docs/studies.md): which run is
which cell, read from its resolved config (a run whose field holds neither level is outside it;
a cell must be one variant), and the effects table (scse_dist.study.stats.factorial_effects).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from scse_dist.config import RunConfig
from scse_dist.study.stats import Effect, factorial_effects
from scse_dist.task_registry import field_value
from scse_dist.typed_yaml import ConfigError

DEFAULT_DEPTHS = [1, 4, 8, 32]


@dataclass
class Factorial:
    factors: dict[str, list[Any]]  # dotted run-config field -> [level 0, level 1]
    depths: list[int] = field(default_factory=lambda: list(DEFAULT_DEPTHS))

    @property
    def names(self) -> list[str]:
        # the field's name; a section's `kind` by the section's (train.optimizer.kind: optimizer)
        return [key.split(".")[-2] if key.endswith(".kind") else key.split(".")[-1]
                for key in self.factors]

    def cell_of(self, cfg: RunConfig) -> Optional[tuple[int, ...]]:
        """The run's levels (0 or 1 per factor), or None when a field holds neither level."""
        levels = []
        for key, (low, high) in self.factors.items():
            section, _, rest = key.partition(".")
            value = field_value(getattr(cfg, section, None), rest)
            if value not in (low, high):
                return None
            levels.append(int(value == high))
        return tuple(levels)


def parse_factorial(body: Any) -> Optional[Factorial]:
    """The spec's report.factorial (None when absent); ConfigError naming the field."""
    if body is None:
        return None
    where = "report.factorial"
    if not isinstance(body, dict) or set(body) - {"factors", "depths"}:
        raise ConfigError(f"{where}: expected {{factors: {{field: [level 0, level 1]}}, "
                          f"depths: [...]}}, got {body!r}")
    factors = body.get("factors")
    if not isinstance(factors, dict) or not 2 <= len(factors) <= 4:
        raise ConfigError(f"{where}.factors: 2 to 4 run-config fields, got {factors!r}")
    for key, levels in factors.items():
        if "." not in str(key) or not isinstance(levels, list) or len(levels) != 2 \
                or levels[0] == levels[1]:
            raise ConfigError(f"{where}.factors.{key}: a dotted run-config field with two "
                              f"different levels [level 0, level 1], got {levels!r}")
    depths = body.get("depths", list(DEFAULT_DEPTHS))
    if not isinstance(depths, list) or not depths or not all(type(d) is int for d in depths):
        raise ConfigError(f"{where}.depths: a non-empty list of loop depths, got {depths!r}")
    return Factorial({str(k): v for k, v in factors.items()}, depths)


# (task, metric) -> depth -> effect name -> Effect
Effects = dict[tuple[str, str], dict[int, dict[str, Effect]]]


def effects(design: Factorial, runs: list, metrics: dict[str, list[str]]) -> tuple[Effects, str]:
    """The effects per task (its first metric) and depth, and a note: why there are none, or ""."""
    variants: dict[tuple[int, ...], set[str]] = {}
    placed = []
    for run in runs:
        cell = design.cell_of(run.config) if run.config is not None else None
        if cell is not None:
            variants.setdefault(cell, set()).add(run.variant)
            placed.append((cell, run))
    shared = {c: sorted(v) for c, v in variants.items() if len(v) > 1}
    if shared:
        cell, names = next(iter(shared.items()))
        return {}, f"not a factorial: cell {cell} holds {len(names)} variants ({', '.join(names)})"
    if len(variants) < 2 ** len(design.factors):
        return {}, (f"{len(variants)} of {2 ** len(design.factors)} cells have finished runs: "
                    "no effects")
    out: Effects = {}
    for task, names in metrics.items():
        metric = names[0]
        for depth in design.depths:
            cells: dict[tuple[int, ...], dict[int, float]] = {}
            for cell, run in placed:
                value = run.results.get(task, {}).get(depth, {}).get(metric)
                if isinstance(value, (int, float)) and value == value:
                    cells.setdefault(cell, {})[run.seed] = float(value)
            if len(cells) == len(variants):
                out.setdefault((task, metric), {})[depth] = factorial_effects(cells, design.names)
    return out, ""


def _cell(e: Optional[Effect]) -> str:
    if e is None:
        return ""
    if e.low is None or e.high is None:
        return f"{e.mean:+.4g} (n={e.n})"
    return f"{e.mean:+.4g} [{e.low:+.4g}, {e.high:+.4g}]" + ("*" if e.excludes_zero() else "")


def markdown(design: Factorial, found: Effects, note: str) -> list[str]:
    levels = " × ".join(f"{k} ({low} → {high})" for k, (low, high) in design.factors.items())
    lines = [f"## Factorial: {levels}", "",
             "Effects on the metric (level 1 minus level 0): a main effect averaged over the other "
             "factors; a two-way interaction is how much the first factor's effect changes from "
             "the second's level 0 to its level 1, averaged over the rest; the three-way, how "
             "much that changes across the third. 95% t intervals over seeds, paired by seed "
             "(each seed's contrast over the seeds every cell has) or, with fewer than two "
             "shared seeds, Welch's over the cell means; * excludes 0.", ""]
    if note:
        return lines + [note, ""]
    for (task, metric), by_depth in found.items():
        depths = sorted(by_depth)
        names = list(next(iter(by_depth.values())))
        lines += [f"### {task} {metric}", "",
                  "| effect | " + " | ".join(f"T={d}" for d in depths) + " | intervals |",
                  "|---|" + "---:|" * len(depths) + "---|"]
        for name in names:
            first = by_depth[depths[0]][name]
            how = f"paired, {first.n} seeds" if first.paired else f"Welch, >= {first.n} seeds"
            lines.append(f"| {name} | " + " | ".join(_cell(by_depth[d].get(name))
                                                      for d in depths) + f" | {how} |")
        lines.append("")
    return lines


def numbers(found: Effects) -> dict:
    return {f"{task}/{metric}": {str(d): {n: asdict(e) for n, e in by_name.items()}
                                 for d, by_name in by_depth.items()}
            for (task, metric), by_depth in found.items()}
