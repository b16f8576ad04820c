"""Each looped arm of the retrofit showcase at every T against the untied arm at its only depth
(T = 6, its 8 blocks), paired by seed: scse-report pairs variants at common depths only, and the
untied model has one. Then each looped arm against itself at T = 1. Reads the study's runs
through scse_dist.study (the runs' eval/*.json); the untied arm from a second study when given.

    python research/results/retrofit-showcase-d128-2026-12-07/vs_untied.py \
        studies/retrofit-showcase-d128 [studies/retrofit-showcase-d128 (the untied arm's study)]
"""

from __future__ import annotations

import sys

from scse_dist.study.collect import load_study
from scse_dist.study.compare import values_by_depth
from scse_dist.study.stats import t_interval


def main(study_dir: str, untied_dir: str) -> None:
    final = [r for d in dict.fromkeys((study_dir, untied_dir)) for r in load_study(d).runs
             if r.stage == "final" and not r.missing]
    arms = list(dict.fromkeys(r.variant for r in final if r.variant != "untied"))
    for task in ("heldout", "validation"):
        base = values_by_depth([r for r in final if r.variant == "untied"], task, "ppl")
        if len(base) != 1:
            raise SystemExit(f"vs_untied: untied has depths {sorted(base)} for {task}, "
                             "expected one")
        (t_u, ref), = base.items()
        print(f"\n{task} ppl: arm at T minus untied at T={t_u} (paired by seed, 95% t interval)")
        print("| arm | " + " | ".join(f"T={d}" for d in (1, 2, 4, 8, 16, 32)) + " |")
        print("|---|" + "---:|" * 6)
        for arm in arms:
            by_depth = values_by_depth([r for r in final if r.variant == arm], task, "ppl")
            cells = []
            for d in (1, 2, 4, 8, 16, 32):
                seeds = sorted(set(by_depth.get(d, {})) & set(ref))
                if len(seeds) < 2:
                    cells.append("-")
                    continue
                iv = t_interval([by_depth[d][s] - ref[s] for s in seeds])
                cells.append(f"{iv.mean:+.1f} ({iv.low:+.1f}, {iv.high:+.1f})")
            print(f"| {arm} - untied | " + " | ".join(cells) + " |")
        print(f"\n{task} ppl: each looped arm at T minus itself at T=1 (does depth pay)")
        for arm in arms:
            by_depth = values_by_depth([r for r in final if r.variant == arm], task, "ppl")
            one = by_depth[1]
            cells = []
            for d in (2, 4, 8, 16, 32):
                seeds = sorted(set(by_depth[d]) & set(one))
                iv = t_interval([by_depth[d][s] - one[s] for s in seeds])
                cells.append(f"T={d} {iv.mean:+.1f} ({iv.low:+.1f}, {iv.high:+.1f})")
            print(f"{arm}: " + "; ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
