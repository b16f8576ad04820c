"""Score several studies' runs on a validation text, where rates and variants are chosen (never on
a test set): ppl per loop depth, mean and 95% Student-t interval over seeds per variant, the worst
depth ratios ppl(T=8)/ppl(T=2) and ppl(32)/ppl(8) over the seeds, and paired differences.

    python benchmarks/score_validation.py STUDY_DIR [STUDY_DIR ...] --data data/eval/owt-valid.txt \
        [--pair A B ...] [--json out.json]
    python benchmarks/score_validation.py STUDY_DIR ... --name heldout   # read the test results

Within one study, the spec's `validation:` section does this as a stage of the study, and
`scse-study SPEC --report` shows it; this script merges several studies. With --data, each run's
export is evaluated once into RUN/eval/<--name>.json (at the run's
eval.depths and eval.max_batches); a rerun reads what is there. Without it, RUN/eval/<--name>.json
is read as the study wrote it. Variants are merged across studies by name (the seeds of
`scse-forward-lr0.004` from two studies are one variant; a seed found twice is an error);
--pair A B prints A - B at each depth over the seeds both have.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runs_of(study: Path) -> list[dict]:
    path = study / "runs.json"
    if not path.is_file():
        sys.exit(f"score_validation: {path}: no such file (is {study} a study directory?)")
    return [r for r in json.loads(path.read_text()) if r.get("stage", "final") == "final"]


def score(run_dir: Path, data: str | None, name: str) -> dict[int, float] | None:
    """{depth: ppl} of RUN/eval/<name>.json, scored by the study's validation stage
    (scse_dist.study.validation.score) from RUN/export on `data` when missing."""
    from scse_dist.study.validation import score as validation_score

    rows = validation_score(run_dir, data, name)
    return None if rows is None else {int(r["depth"]): float(r["ppl"]) for r in rows}


def fmt(iv) -> str:
    return f"{iv.mean:.1f}" if iv.half_width is None else f"{iv.mean:.1f} ± {iv.half_width:.1f}"


def worst(seeds: dict[int, dict[int, float]], deep: int, shallow: int) -> str:
    """The largest ppl(deep)/ppl(shallow) over the seeds ('-' where a depth is missing)."""
    ratios = [s[deep] / s[shallow] for s in seeds.values() if deep in s and shallow in s]
    return f"{max(ratios):.3f}" if ratios else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("studies", nargs="+", type=Path, help="study directories (with runs.json)")
    p.add_argument("--data", help="validation text or JSONL to evaluate on (e.g. owt-valid.txt); "
                   "without it, RUN/eval/<--name>.json is only read")
    p.add_argument("--name", default="validation-owt", help="results name under RUN/eval/")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"))
    p.add_argument("--json", type=Path, help="also write every run's scores here")
    args = p.parse_args(argv)
    if args.data is not None and not Path(args.data).is_file():
        sys.exit(f"score_validation: --data {args.data}: no such file")

    from scse_dist.study.stats import t_interval

    scores: dict[str, dict[int, dict[int, float]]] = {}  # variant -> seed -> depth -> ppl
    where: dict[tuple[str, int], str] = {}
    for study in args.studies:
        for r in runs_of(study):
            key = (r["variant"], int(r["seed"]))
            if key in where:
                sys.exit(f"score_validation: {key[0]} seed {key[1]} is in {where[key]} and in "
                         f"{r['run_dir']}: name one of the studies only")
            ppl = score(Path(r["run_dir"]), args.data, args.name)
            if ppl is not None:
                where[key] = r["run_dir"]
                scores.setdefault(key[0], {})[key[1]] = ppl
    if not scores:
        sys.exit(f"score_validation: no run of these studies has eval/{args.name}.json"
                 + ("" if args.data else " (give --data to evaluate it)"))

    def find(v: str) -> str:
        if v not in scores:
            sys.exit(f"score_validation: --pair {v}: no such variant (have: "
                     f"{', '.join(sorted(scores))})")
        return v

    depths = sorted({d for seeds in scores.values() for ppl in seeds.values() for d in ppl})
    print(f"{args.name} ppl ({args.data or 'as the studies wrote it'}): mean ± 95% half-width "
          f"over seeds")
    print("| variant | n | " + " | ".join(f"T={d}" for d in depths) + " | T8/T2 max | T32/T8 max |")
    print("|---|---:|" + "---:|" * (len(depths) + 2))
    for v, seeds in sorted(scores.items()):
        # an untied model has its one depth only: '-' elsewhere
        cells = [fmt(t_interval(vals)) if (vals := [s[d] for s in seeds.values() if d in s])
                 else "-" for d in depths]
        ratios = [worst(seeds, 8, 2), worst(seeds, 32, 8)]
        print(f"| {v} | {len(seeds)} | " + " | ".join(cells + ratios) + " |")
    for a, b in args.pair:
        a, b = find(a), find(b)
        common = sorted(set(scores[a]) & set(scores[b]))
        if not common:
            print(f"\n{a} - {b}: no seed in common")
            continue
        print(f"\n{a} - {b}, paired over seeds {common}:")
        for d in depths:
            diffs = [scores[a][s][d] - scores[b][s][d] for s in common]
            iv = t_interval(diffs)
            ci = "" if iv.low is None else f" ({iv.low:+.1f} to {iv.high:+.1f})"
            print(f"  T={d}: {iv.mean:+.1f}{ci}  per seed " + " ".join(f"{x:+.1f}" for x in diffs))
    if args.json:
        args.json.write_text(json.dumps(scores, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
