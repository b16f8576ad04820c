"""`scse-report`: the report of runs (their eval/*.json) or of a study dir.

    scse-report runs/scse runs/additive runs/untied --out reports/main   # compare several runs
    scse-report --study runs/my-study      # a study's seeds aggregated (scse_dist.study.report)

A run's report is a markdown table (one row per run, task and metric, one column per depth) and
a quality-frontier plot (each task's headline metric against depth, one line per run).
"""

# above both eval and study (study imports eval, never the reverse), so one command serves both

from __future__ import annotations

from typing import Sequence

from scse_dist.cli_errors import cli_main, command_parser
from scse_dist.eval.report import write_report


@cli_main("scse-report")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad arguments; 65 a results JSON that is not one; 66 a run without
    results. Errors are one line on stderr naming the file."""
    p = command_parser("scse-report", __doc__)
    p.add_argument("runs", nargs="*", help="run dirs (each holding eval/*.json)")
    p.add_argument("--study", help="a study dir instead of runs: seeds aggregated, paired "
                   "comparisons, flags (default --out STUDY/report; wandb offline unless every run "
                   "disables it)")
    p.add_argument("--out", default=None, help="output dir for report.md and frontier.png "
                   "(default: report)")
    p.add_argument("--wandb", choices=["offline", "online", "disabled"], default=None,
                   help="also log the numbers to wandb (group scse-report; a study's own group)")
    args = p.parse_args(argv)
    if args.study:
        if args.runs:
            p.error("give run dirs or --study, not both")
        from scse_dist.study.report import write_study_report

        print(f"wrote {write_study_report(args.study, args.out, args.wandb or 'auto')}")
        return 0
    if not args.runs:
        p.error("give run dirs, or --study STUDY_DIR")
    from scse_dist.train.metrics_config import WandbConfig

    paths = write_report(args.runs, args.out or "report",
                         WandbConfig(enabled=True, mode=args.wandb or "disabled"),
                         wandb_name="scse-report", wandb_group="scse-report")
    print(f"wrote {paths['report']} and {paths['plot']}"
          + "".join(f" and {paths[k]}" for k in ("curve", "downstream_curve") if paths[k]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
