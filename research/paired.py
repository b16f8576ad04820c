"""Two variants of two studies compared seed by seed: A - B of one task's metric at each depth,
with the 95% paired t interval over the seeds both have, each value read from the run's own
RUN/eval/TASK.json through the study's own reader and comparison (scse_dist.study.collect,
scse_dist.study.compare), as the study report pairs two variants of one study.

    python research/paired.py studies/rehearsal-depth1-d128/scse-deeploop-u1 \
        studies/rehearsal-adamw-d128/scse-deeploop --task wikitext --metric word_ppl

A group is STUDY_DIR/VARIANT; only its final-stage runs count (a sweep's runs differ in rate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scse_dist.study.collect import StudyRun, load_study
from scse_dist.study.compare import paired, values_by_depth


def final_runs(group: Path) -> list[StudyRun]:
    """The group's final-stage runs, renamed to the group's path (two studies may share names)."""
    runs = [r for r in load_study(group.parent).runs
            if r.variant == group.name and r.stage == "final"]
    for run in runs:
        run.variant = str(group)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--task", default="wikitext")
    parser.add_argument("--metric", default="word_ppl")
    args = parser.parse_args()
    runs = final_runs(args.a) + final_runs(args.b)
    va, vb = (values_by_depth([r for r in runs if r.variant == str(g)], args.task, args.metric)
              for g in (args.a, args.b))
    seen_a, seen_b = (sorted({s for by_seed in v.values() for s in by_seed}) for v in (va, vb))
    seeds = sorted(set(seen_a) & set(seen_b))
    print(f"{args.task} {args.metric}: A = {args.a} (seeds {seen_a}), "
          f"B = {args.b} (seeds {seen_b}); paired over seeds {seeds}")
    print(f"{'T':>3} {'A':>9} {'B':>9} {'A - B':>8}  95% interval")
    for t, diff in paired(runs, str(args.a), str(args.b), args.task, args.metric).items():
        both = sorted(set(va[t]) & set(vb[t]))
        mean_a = sum(va[t][s] for s in both) / len(both)
        mean_b = sum(vb[t][s] for s in both) / len(both)
        interval = "" if diff.low is None else f"{diff.low:+.1f} to {diff.high:+.1f}"
        print(f"{t:>3} {mean_a:9.1f} {mean_b:9.1f} {diff.mean:+8.1f}  {interval}")


if __name__ == "__main__":
    main()
