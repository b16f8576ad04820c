"""Small-sample statistics for a study: Student-t quantiles (scipy's), 95% intervals over seeds,
and the effects of a two-level factorial."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p for Student's t with `df` degrees of freedom, e.g.
    t_quantile(0.975, 2) = 4.3027 (scipy.stats.t.ppf; df need not be whole: Welch's)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile: need 0 < p < 1 and df > 0, got p={p}, df={df}")
    from scipy.stats import t  # here: scipy.stats takes seconds to import

    return float(t.ppf(p, df))


@dataclass(frozen=True)
class Interval:
    """Mean over n values, the sample standard deviation (n - 1) and a two-sided t interval (None
    with one value: one seed resolves nothing)."""

    n: int
    mean: float
    std: Optional[float]
    low: Optional[float]
    high: Optional[float]

    @property
    def half_width(self) -> Optional[float]:
        return None if self.high is None else self.high - self.mean

    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """mean +- t_{(1+level)/2, n-1} * std / sqrt(n) over `values` (finite: the caller drops NaN)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("t_interval: no values")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(n, mean, None, None, None)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return Interval(n, mean, std, mean - half, mean + half)


@dataclass(frozen=True)
class Effect:
    """One effect of a two-level factorial: its estimate and 95% interval, paired over the seeds
    every cell has (n of them) or Welch's over the cell means (n: a cell's fewest seeds)."""

    mean: float
    low: Optional[float]
    high: Optional[float]
    n: int
    paired: bool

    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def factorial_effects(cells: Mapping[tuple[int, ...], Mapping[int, float]],
                      factors: Sequence[str], level: float = 0.95) -> dict[str, Effect]:
    """Main effects and interactions of a 2^k factorial: `cells` maps levels (0 or 1 per factor)
    to {seed: value}, every cell filled. The effect of a set S of factors is the sum over cells
    of prod_{f in S} (+1 at level 1, -1 at level 0) * value / 2^(k - |S|). Keys: "a", "a x b"."""
    k = len(factors)
    grid = list(itertools.product((0, 1), repeat=k))
    absent = [c for c in grid if not cells.get(c)]
    if absent:
        raise ValueError(f"factorial_effects: no value in cell {absent[0]} of {len(grid)}")
    shared = sorted(set.intersection(*(set(cells[c]) for c in grid)))
    out = {}
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            coef = {c: math.prod(1 if c[f] else -1 for f in subset) / 2 ** (k - size)
                    for c in grid}
            name = " x ".join(factors[f] for f in subset)
            if len(shared) >= 2:
                iv = t_interval([sum(coef[c] * cells[c][s] for c in grid) for s in shared], level)
                out[name] = Effect(iv.mean, iv.low, iv.high, iv.n, paired=True)
            else:
                out[name] = _welch_effect(coef, cells, level)
    return out


def _welch_effect(coef: Mapping[tuple[int, ...], float],
                  cells: Mapping[tuple[int, ...], Mapping[int, float]], level: float) -> Effect:
    """sum c_i * mean_i with Welch-Satterthwaite's t interval (none if a cell has one seed)."""
    stats = {c: t_interval(list(cells[c].values())) for c in coef}
    mean = sum(coef[c] * iv.mean for c, iv in stats.items())
    n = min(iv.n for iv in stats.values())
    if n < 2:
        return Effect(mean, None, None, n, paired=False)
    parts = {c: coef[c] ** 2 * (iv.std or 0.0) ** 2 / iv.n for c, iv in stats.items()}
    var = sum(parts.values())
    if var == 0:
        return Effect(mean, mean, mean, n, paired=False)
    df = var ** 2 / sum(p ** 2 / (stats[c].n - 1) for c, p in parts.items())
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(var)
    return Effect(mean, mean - half, mean + half, n, paired=False)
