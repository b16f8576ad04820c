"""What the evaluation and report jobs that `scse-launch` schedules run:

    python -m scse_dist.launch.run_job evaluate RUN_DIR TASK   # RUN/eval/TASK.json
    python -m scse_dist.launch.run_job report RUN_DIR          # RUN/eval/report.md

A command line rather than a pickled function, so that any backend can run it.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from scse_dist.cli_errors import cli_main
from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch.scheduler import report_run


@cli_main("scse-launch")
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scse_dist.launch.run_job")
    p.add_argument("what", choices=["evaluate", "report"])
    p.add_argument("run_dir")
    p.add_argument("task", nargs="?")
    args = p.parse_args(argv)
    if args.what == "evaluate":
        if not args.task:
            p.error("evaluate needs a TASK")
        print(f"scse-launch: {args.task}: {evaluate_export(args.run_dir, args.task)}")
    else:
        print(f"scse-launch: report {report_run(args.run_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
