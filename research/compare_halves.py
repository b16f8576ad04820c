"""The d128 rehearsal's AdamW half beside the factorial's Muon half, on the validation text.

    python research/compare_halves.py studies/rehearsal-adamw-d128 \
        research/results/factorial-confirm-d128-2026-12-06/validation.json --depth 4

Reads each final run's RUN/eval/validation.json (the study's validation stage) and the Muon
half's per-seed scores (variant -> seed -> T -> ppl, written by the factorial's validation
scoring), and prints per half the recurrence and residual main effects and their interaction
(paired over the seeds both halves share; scse_dist.study.stats.factorial_effects), then the
three-factor table with the optimizer as the third factor.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scse_dist.study.collect import load_study
from scse_dist.study.compare import values_by_depth
from scse_dist.study.stats import factorial_effects

# (recurrence: additive 0 / scse 1, residual: preln 0 / deeploop 1)
CELLS = {(0, 0): "additive-preln", (0, 1): "additive-deeploop", (1, 0): "scse-preln",
         (1, 1): "scse-deeploop"}


def adamw_half(study: Path, depth: int) -> dict[tuple[int, ...], dict[int, float]]:
    """Each cell's final runs' validation ppl by seed (the study's own reader)."""
    runs = [r for r in load_study(study).runs if r.stage == "final"]
    return {key: values_by_depth([r for r in runs if r.variant == variant], "validation",
                                 "ppl").get(depth, {})
            for key, variant in CELLS.items()}


def muon_half(path: Path, depth: int) -> dict[tuple[int, ...], dict[int, float]]:
    scores = json.loads(path.read_text())
    return {key: {int(s): by_t[str(depth)] for s, by_t in scores[f"{v}-muon"].items()}
            for key, v in CELLS.items()}


def show(title: str, effects: dict) -> None:
    print(f"\n{title}")
    for name, e in effects.items():
        interval = "" if e.low is None else f" ({e.low:+.1f} to {e.high:+.1f})"
        print(f"  {name:32s} {e.mean:+7.1f}{interval}  n={e.n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("muon", type=Path)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    adamw, muon = adamw_half(args.study, args.depth), muon_half(args.muon, args.depth)
    # the cell means over the seeds every cell of both halves has, as the effects pair them
    shared = sorted(set.intersection(*(set(c) for c in [*adamw.values(), *muon.values()])))
    print(f"cell means over seeds {shared}")
    for key, variant in CELLS.items():
        a, m = (sum(half[key][s] for s in shared) / len(shared) for half in (adamw, muon))
        print(f"{variant:18s} AdamW+150 {a:7.1f}  Muon {m:7.1f}")
    factors = ["recurrence", "residual"]
    show(f"AdamW with 150 warmup steps, validation ppl at T={args.depth}",
         factorial_effects(adamw, factors))
    show(f"Muon (factorial-confirm-d128), validation ppl at T={args.depth}",
         factorial_effects(muon, factors))
    both = {(*k, 0): v for k, v in muon.items()} | {(*k, 1): v for k, v in adamw.items()}
    show("both halves, optimizer Muon 0 / AdamW 1",
         factorial_effects(both, [*factors, "optimizer"]))


if __name__ == "__main__":
    main()
