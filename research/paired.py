"""Two groups of runs compared seed by seed: A - B of one task's metric at each depth, with the
95% paired t interval over the seeds both have (scse_dist.study.stats.t_interval), each run's
value read from its own RUN/eval/TASK.json.

    python research/paired.py studies/rehearsal-depth1-d128/scse-deeploop-u1 \
        studies/rehearsal-adamw-d128/scse-deeploop --task wikitext --metric word_ppl

A group is a variant's folder in a study (its runs are NAME-seedN/; a sweep's NAME-lrX-seedN/
are not final runs and are skipped). For pairs of two variants of one study, the study report
does the same; this serves runs of two studies.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from scse_dist.study.stats import t_interval

FINAL = re.compile(r".*-seed(\d+)$")


def by_seed(group: Path, task: str, metric: str) -> dict[int, dict[int, float]]:
    """seed -> depth -> value, for each final run of the group that has RUN/eval/TASK.json."""
    values: dict[int, dict[int, float]] = {}
    for run in sorted(group.iterdir()):
        match = FINAL.match(run.name)
        result = run / "eval" / f"{task}.json"
        if match is None or "-lr" in run.name or not result.is_file():
            continue
        rows = json.loads(result.read_text())["results"]
        values[int(match.group(1))] = {r["depth"]: r[metric] for r in rows}
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--task", default="wikitext")
    parser.add_argument("--metric", default="word_ppl")
    args = parser.parse_args()
    a, b = by_seed(args.a, args.task, args.metric), by_seed(args.b, args.task, args.metric)
    seeds = sorted(set(a) & set(b))
    print(f"{args.task} {args.metric}: A = {args.a} (seeds {sorted(a)}), "
          f"B = {args.b} (seeds {sorted(b)}); paired over seeds {seeds}")
    print(f"{'T':>3} {'A':>9} {'B':>9} {'A - B':>8}  95% interval")
    depths = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds))) if seeds else []
    for t in depths:
        diff = t_interval([a[s][t] - b[s][t] for s in seeds])
        mean_a = sum(a[s][t] for s in seeds) / len(seeds)
        mean_b = sum(b[s][t] for s in seeds) / len(seeds)
        interval = "" if diff.low is None else f"{diff.low:+.1f} to {diff.high:+.1f}"
        print(f"{t:>3} {mean_a:9.1f} {mean_b:9.1f} {diff.mean:+8.1f}  {interval}")


if __name__ == "__main__":
    main()
