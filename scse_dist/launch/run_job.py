"""What the jobs that `scse-launch` and `scse-study` submit run, on every backend:

    python -m scse_dist.launch.run_job train CONFIG [key=value ...] [--evaluate]
                                             [--schedule-evals B]
    python -m scse_dist.launch.run_job evaluate RUN_DIR TASK   # RUN/eval/TASK.json
    python -m scse_dist.launch.run_job report RUN_DIR          # RUN/eval/report.md
    python -m scse_dist.launch.run_job run-dir CONFIG [key=value ...]  # prints RUN (absolute)

`train` runs in every task of the job (rank 0 first schedules the eval jobs on backend B, or with
`--evaluate` evaluates after training); its exit status is training's, and a crash may requeue
the job (scse_dist.launch.retries). `run-dir` serves slurm/pretrain.sh.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from scse_dist.cli_errors import cli_main
from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch.children import run_child
from scse_dist.launch.retries import CrashWatch, after_failure
from scse_dist.launch.scheduler import LOGS, evaluate_all, report_run, schedule_evals


def train_job(config: str, overrides: list[str], evaluate: bool, schedule_on: str | None) -> int:
    from scse_dist.config import load_config
    from scse_dist.distributed import resolve_dist_env
    from scse_dist.launch.backends import get_backend

    cfg = load_config(config, overrides)
    first = resolve_dist_env(os.environ).rank == 0
    if schedule_on and first:
        backend = get_backend(schedule_on)
        job_id = backend.current_job()
        if job_id:
            schedule_evals(cfg.eval, cfg.name, cfg.run_dir, job_id, backend)
    # evaluated below: the trainer's own held-out evaluation after training would repeat it
    extra = ["eval.after_train=false"] if evaluate else []
    watch = CrashWatch()  # its stderr passes through, its crash line is kept
    ended = run_child([sys.executable, "-m", "scse_dist.train.cli", "--config", config, *overrides,
                       *extra], on_stderr_line=watch)
    if ended.status == 0 and evaluate and first:
        print(f"scse-launch: report {evaluate_all(cfg.eval.tasks, cfg.run_dir)}", flush=True)
    if ended.status != 0 and ended.signal_name is None:  # failed by itself: retried if a crash
        after_failure(Path(cfg.run_dir).resolve() / LOGS, cfg.launch.max_retries, ended.status,
                      resolve_dist_env(os.environ).rank, watch)
    # a trainer a signal killed: the shell's 128 + N (a negative exit status would wrap mod 256)
    return ended.status if ended.status >= 0 else 128 - ended.status


@cli_main("scse-launch")
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scse_dist.launch.run_job")
    p.add_argument("what", choices=["train", "evaluate", "report", "run-dir"])
    p.add_argument("target", help="train, run-dir: the run config; evaluate, report: the run dir")
    p.add_argument("rest", nargs="*",
                   help="train, run-dir: key=value overrides; evaluate: the TASK")
    p.add_argument("--evaluate", action="store_true", help="train: then evaluate and report here")
    p.add_argument("--schedule-evals", metavar="BACKEND",
                   help="train: first submit the evaluation jobs after this job on BACKEND")
    args = p.parse_intermixed_args(argv)
    if args.what == "train":
        return train_job(args.target, args.rest, args.evaluate, args.schedule_evals)
    if args.what == "run-dir":
        from scse_dist.config import load_config

        print(Path(load_config(args.target, args.rest).run_dir).resolve())
        return 0
    if args.what == "evaluate":
        if len(args.rest) != 1:
            p.error("evaluate needs one TASK")
        print(f"scse-launch: {args.rest[0]}: {evaluate_export(args.target, args.rest[0])}")
    else:
        print(f"scse-launch: report {report_run(args.target)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
