"""`scse-launch`: train, then evaluate and report by themselves, on a batch system or here.

    scse-launch CONFIG [key.sub=value ...]                 # a Slurm job (submitit), evals after it
    scse-launch CONFIG [...] --backend local               # the same job flow, run on this machine
    scse-launch CONFIG [key.sub=value ...] --local         # everything here, in this process
    scse-launch CONFIG [key.sub=value ...] --after-job ID  # only the evaluation jobs of job ID
    scse-launch CONFIG [key.sub=value ...] --evaluate      # evaluate the trained run here, report

The training job runs `python -m scse_dist.launch.run_job train CONFIG ...` (the installed
package), asking for the config's `resources:`, then `--backend-args`; logs are in RUN/logs. On
a cluster its first task submits an afterok evaluation job per `eval.tasks` entry and a report
job after them (once per job id: RUN/eval/scheduled.json); on a backend that runs jobs in place
(local) the job evaluates and reports itself. See docs/launching.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.atomic import atomic_write_text
from scse_dist.cli_errors import cli_main, command_parser
from scse_dist.config import RunConfig, load_config
from scse_dist.eval.config import EvalConfig
from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch.backends import BACKENDS, Backend, BackendError, Job, get_backend
from scse_dist.launch.children import REQUEUE_EXIT_CODE, StoppedBySignal
from scse_dist.resources import Resources
from scse_dist.run_dir import RunDir
from scse_dist.train.batch_config import BatchConfig
from scse_dist.typed_yaml import old_name_notice

SCHEDULED_NAME = "scheduled.json"
LOGS = "logs"  # RUN/logs, STUDY/logs: every backend's job output
RUN_JOB = [sys.executable, "-m", "scse_dist.launch.run_job"]


def report_run(run_dir: str) -> str:
    from scse_dist.eval.report import report_run as write

    return str(write(run_dir)["report"])  # report.md, always written


def training_command(config: str, overrides: Sequence[str], evaluate: bool,
                     schedule_on: Optional[str] = None) -> list[str]:
    """The training job's command on every backend: run_job train CONFIG (absolute: a job may
    start elsewhere), evaluating inside the job or scheduling eval jobs on `schedule_on`."""
    flags = ["--evaluate"] if evaluate else []
    flags += [f"--schedule-evals={schedule_on}"] if schedule_on else []
    return [*RUN_JOB, "train", str(Path(config).resolve()), *overrides, *flags]


def eval_jobs(eval: EvalConfig, name: str, run_dir: str, train_job: str) -> tuple[list[Job], Job]:
    """One job per eval task, afterok on the training job, and the report job (after them)."""
    resolved = Path(run_dir).resolve()
    job = Job(command=[], name=f"{name}-eval", resources=eval.resources,
              log_dir=resolved / LOGS, after=[str(train_job)])
    evals = [dataclasses.replace(job, command=[*RUN_JOB, "evaluate", str(resolved), task])
             for task in eval.tasks]
    report = dataclasses.replace(job, command=[*RUN_JOB, "report", str(resolved)],
                                 name=f"{name}-report", after=[])
    return evals, report


def schedule_evals(eval: EvalConfig, name: str, run_dir: str, train_job: str, backend: Backend
                   ) -> list[str]:
    """Submit the eval jobs (afterok:train_job) and the report job; once per training job id.
    If a submission fails, the jobs already submitted are cancelled."""
    marker = RunDir(Path(run_dir).resolve()).eval / SCHEDULED_NAME
    if marker.is_file() and json.loads(marker.read_text()).get("train_job") == str(train_job):
        print(f"scse-launch: evaluations of job {train_job} were already scheduled ({marker})")
        return []
    evals, report = eval_jobs(eval, name, run_dir, train_job)
    submitted: list[str] = []
    try:
        for job in evals:
            submitted.append(backend.submit(job))
        report_id = backend.submit(dataclasses.replace(report, after=submitted or [str(train_job)]))
    except BackendError:
        for job_id in submitted:
            backend.cancel(job_id)
        raise
    ids = {"train_job": str(train_job), "eval_jobs": dict(zip(eval.tasks, submitted)),
           "report_job": report_id}
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps(ids, indent=2) + "\n")
    print(f"scse-launch: after job {train_job}: eval jobs {ids['eval_jobs']}, report job "
          f"{ids['report_job']}", flush=True)
    return [*submitted, report_id]


def evaluate_all(tasks: Sequence[str], run_dir: str) -> str:
    """Every task of `tasks` without a complete result yet, then the run's report.md."""
    for task in tasks:
        if not RunDir(run_dir).evaluated(task):
            evaluate_export(run_dir, task)
    return report_run(run_dir)


def run_local(cfg: RunConfig) -> str:
    """Train in this process, then every task of eval.tasks, then the report. Returns report.md."""
    from scse_dist.train.loop import train

    # The tasks below include held-out: the trainer's own after-train evaluation would repeat it.
    summary = train(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, after_train=False)))
    if summary["preempted"]:  # SIGINT/SIGTERM: the trainer saved; nothing to evaluate yet
        raise StoppedBySignal(str(summary["preempted"]), REQUEUE_EXIT_CODE, "training")
    for task in cfg.eval.tasks:
        evaluate_export(cfg.run_dir, task)
    return report_run(cfg.run_dir)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("scse-launch", __doc__)
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run everything in this process")
    where.add_argument("--after-job", metavar="JOBID",
                       help="only submit the evaluation and report jobs, afterok:JOBID")
    where.add_argument("--evaluate", action="store_true",
                       help="evaluate the trained run on every eval task here, then its report")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="slurm",
                   help="the batch system the jobs go to (default slurm)")
    add_backend_args(p, "the training job, after the config's resources: (e.g. "
                        "'--time=2-0 --account=me' for Slurm)")
    return p


def add_backend_args(p: argparse.ArgumentParser, what: str) -> None:
    """--backend-args, and its old name --sbatch-args (read for now, with a notice)."""
    p.add_argument("--backend-args", default="", help=f"the backend's own flags for {what}")
    p.add_argument("--sbatch-args", default=None, help=argparse.SUPPRESS)


def backend_args(args: argparse.Namespace, prog: str) -> str:
    if args.sbatch_args is None:
        return args.backend_args
    old_name_notice("--sbatch-args", "--backend-args", prog)
    return " ".join(a for a in (args.backend_args, args.sbatch_args) if a)


def check_world_batch(batch: BatchConfig, res: Resources) -> None:
    """ConfigError if the global batch does not divide at resources.nodes x tasks_per_node."""
    batch.grad_accum_for(res.nodes * res.tasks_per_node, world_from=(
        f"from resources.nodes {res.nodes} x resources.tasks_per_node {res.tasks_per_node}"))


def submit_training(args: argparse.Namespace, name: str, resources: Resources, run_dir: str,
                    backend: Backend) -> int:
    """Submit the training job and print its id alone on stdout; 0, or the job's exit status
    where the backend ran it in place (local)."""
    in_place = backend.runs_in_place
    command = training_command(args.config, args.overrides, evaluate=in_place,
                               schedule_on=None if in_place else backend.name)
    job = Job(command=command, name=name, resources=resources,
              log_dir=Path(run_dir).resolve() / LOGS,
              backend_args=shlex.split(backend_args(args, "scse-launch")))
    job_id = backend.submit(job)
    print(job_id, flush=True)
    status = backend.ended_with(job_id)  # a job run in place: its status is ours
    if status:
        print(f"scse-launch: training job {job_id} exited {status} (its logs say why)",
              file=sys.stderr)
    return status or 0


@cli_main("scse-launch")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 submitted (or, --local, done); 1 the backend refused a job; 2 bad config
    (a global batch the training job's world, nodes x tasks_per_node, cannot divide too);
    65 bad input data; 66 an input the config names missing or unreadable (checked before the
    training job queues, and --local); 75 stopped by SIGINT or SIGTERM, the run saved (rerun to
    resume), or (--local) the run dir held by another process (its lock); with --backend local,
    the training job's own status."""
    args = build_parser().parse_intermixed_args(argv)  # flags anywhere among the overrides
    cfg = load_config(args.config, args.overrides)
    try:
        return _launch(args, cfg)
    except StoppedBySignal as exc:
        print(f"scse-launch: {exc}", file=sys.stderr, flush=True)
        return exc.status


def _launch(args: argparse.Namespace, cfg: RunConfig) -> int:
    from scse_dist.data.preflight import check_run_data, check_then_build

    if args.local:
        check_then_build(cfg, args.config, args.overrides)  # bad data: one line before torch
        print(f"scse-launch: report {run_local(cfg)}")
        return 0
    if args.evaluate:
        print(f"scse-launch: report {evaluate_all(cfg.eval.tasks, cfg.run_dir)}")
        return 0
    try:
        if args.after_job:
            schedule_evals(cfg.eval, cfg.name, cfg.run_dir, args.after_job,
                           get_backend(args.backend))
            return 0
        check_world_batch(cfg.train.batch, cfg.resources)  # a bad batch: before it queues
        check_run_data(cfg, args.config, args.overrides)  # and the run's inputs, as it will
        return submit_training(args, cfg.name, cfg.resources, cfg.run_dir,
                               get_backend(args.backend))
    except BackendError as exc:
        print(f"scse-launch: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
