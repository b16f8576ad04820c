"""`scse-launch`: train, then evaluate and report by themselves, on a batch system or here.

    scse-launch CONFIG [key.sub=value ...]                 # sbatch slurm/pretrain.sh CONFIG ...
    scse-launch CONFIG [...] --backend local               # the same job flow, run on this machine
    scse-launch CONFIG [key.sub=value ...] --local         # everything here, in this process
    scse-launch CONFIG [key.sub=value ...] --after-job ID  # only the evaluation jobs of job ID
    scse-launch CONFIG [key.sub=value ...] --evaluate      # evaluate the trained run here, then report

The training job is the backend's batch script (scse_dist.launch.backends: `slurm` runs
slurm/pretrain.sh through sbatch, `local` runs launch/pretrain-local.sh here). On Slurm, the
training job calls `--after-job $SLURM_JOB_ID` first thing: that submits one job per task in
`eval.tasks` with an afterok dependency on it and a report job after all of them. So evaluation
starts only once training succeeded; if training fails, Slurm never starts them (a local cluster
with `kill_invalid_depend` cancels them). A requeued training job keeps its id and runs
pretrain.sh again: the jobs already scheduled for that id are recorded in
`RUN/eval/scheduled.json`, so they are not submitted twice. The local backend's script evaluates
inside the training job instead (its jobs run one after another anyway).

Every evaluation job, and `--local`, runs the same `evaluate_export` (scse_dist.eval.export_eval,
as the trainer and a study do): the export's config says which data each task reads, and
`run_task` writes `RUN/eval/<task>.json`; `report_run` then writes
`RUN/eval/report.md` and `frontier.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from scse_dist.atomic import atomic_write_text
from scse_dist.cli_errors import EXIT_CONFIG, cli_main, command_parser
from scse_dist.config import RunConfig, load_config
from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch.backends import BACKENDS, Backend, BackendError, Job, Resources, get_backend
from scse_dist.run_dir import RunDir

CHECKOUT = Path(__file__).resolve().parents[2]
SCHEDULED_NAME = "scheduled.json"


def report_run(run_dir: str) -> str:
    from scse_dist.eval.report import report_run as write

    return write(run_dir)["report"]


def eval_resources(cfg: RunConfig) -> Resources:
    """What each evaluation job asks for: the eval.slurm_* fields, one task on one node."""
    e = cfg.eval
    return Resources(nodes=1, tasks_per_node=1, gpus_per_node=e.slurm_gpus, cpus_per_task=e.slurm_cpus,
                     time_min=e.slurm_time_min, partition=e.slurm_partition)


def eval_jobs(cfg: RunConfig, train_job: str) -> tuple[list[Job], Job]:
    """One job per eval task, afterok on the training job; the report job, whose dependencies
    (the eval jobs' ids) are filled in once they are known."""
    run_dir = Path(cfg.run_dir).resolve()
    command = [sys.executable, "-m", "scse_dist.launch.run_job"]
    job = Job(command=[], name=f"{cfg.name}-eval", resources=eval_resources(cfg),
              log_dir=run_dir / "slurm", after=[str(train_job)])
    evals = [dataclasses.replace(job, command=[*command, "evaluate", str(run_dir), task])
             for task in cfg.eval.tasks]
    report = dataclasses.replace(job, command=[*command, "report", str(run_dir)],
                                 name=f"{cfg.name}-report", after=[])
    return evals, report


def schedule_evals(cfg: RunConfig, train_job: str, backend: Backend) -> list[str]:
    """Submit the eval jobs (afterok:train_job) and the report job; once per training job id.
    If a submission fails, the jobs already submitted are cancelled."""
    marker = RunDir(Path(cfg.run_dir).resolve()).eval / SCHEDULED_NAME
    if marker.is_file() and json.loads(marker.read_text()).get("train_job") == str(train_job):
        print(f"scse-launch: evaluations of job {train_job} were already scheduled ({marker})")
        return []
    evals, report = eval_jobs(cfg, train_job)
    submitted: list[str] = []
    try:
        for job in evals:
            submitted.append(backend.submit(job))
        report_id = backend.submit(dataclasses.replace(report, after=submitted or [str(train_job)]))
    except BackendError:
        for job_id in submitted:
            backend.cancel(job_id)
        raise
    ids = {"train_job": str(train_job), "eval_jobs": dict(zip(cfg.eval.tasks, submitted)),
           "report_job": report_id}
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps(ids, indent=2) + "\n")
    print(f"scse-launch: after job {train_job}: eval jobs {ids['eval_jobs']}, report job "
          f"{ids['report_job']}", flush=True)
    return [*submitted, report_id]


def evaluate_all(cfg: RunConfig) -> str:
    """Every task of eval.tasks that has no complete result yet (a requeued job repeats none;
    a Ctrl-C'd one is evaluated again), then the run's report. Returns report.md."""
    for task in cfg.eval.tasks:
        if not RunDir(cfg.run_dir).evaluated(task):
            evaluate_export(cfg.run_dir, task)
    return report_run(cfg.run_dir)


def run_local(cfg: RunConfig) -> str:
    """Train in this process, then every task of eval.tasks, then the report. Returns report.md."""
    from scse_dist.train.loop import train

    # The tasks below include held-out: the trainer's own after-train evaluation would repeat it.
    train(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, after_train=False)))
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
    p.add_argument("--sbatch-args", default="",
                   help="extra flags of the backend's submit command for the training job, "
                        "e.g. '--nodes=4 --time=2-0' (Slurm)")
    p.add_argument("--script", help="the training batch script (default: the backend's, e.g. "
                                    "slurm/pretrain.sh, of this checkout, else of the current directory)")
    return p


def pretrain_script(given: str | None, relative: str = "slurm/pretrain.sh") -> Path:
    """The batch script to submit. It runs `launch/train.py` from the directory it is submitted
    in, so a checkout is needed anyway: the package's own (an editable install), else the
    current directory's."""
    candidates = [Path(given)] if given else [CHECKOUT / relative, Path.cwd() / relative]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"no training batch script at {' or '.join(map(str, candidates))}; run "
                            "scse-launch from the scse-dist checkout or pass --script")


def submit_training(args: argparse.Namespace, backend: Backend) -> int:
    """The training job: the backend's batch script with CONFIG and the overrides (its own
    defaults for name, resources and logs). Prints the job id alone on stdout; 0 once submitted,
    or, when the backend ran the job in place (local), the job's exit status."""
    try:
        script = pretrain_script(args.script, backend.training_script)
    except FileNotFoundError as exc:
        print(f"scse-launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    job = Job(command=[str(script), args.config, *args.overrides], script=True,
              extra_args=shlex.split(args.sbatch_args))
    job_id = backend.submit(job)
    print(job_id, flush=True)
    status = backend.ended_with(job_id)  # a job run in place: its status is ours
    if status:
        print(f"scse-launch: training job {job_id} exited {status} (its logs say why)", file=sys.stderr)
    return status or 0


@cli_main("scse-launch")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 submitted (or, --local, done); 1 the backend refused a job; 2 bad config or
    no batch script; 65 bad input data; 66 an input missing or unreadable (--local); with
    --backend local, the training job's own status."""
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.local:
        from scse_dist.data.preflight import check_run_data

        check_run_data(cfg, args.config, args.overrides)  # bad data: one line before torch
        print(f"scse-launch: report {run_local(cfg)}")
        return 0
    if args.evaluate:
        print(f"scse-launch: report {evaluate_all(cfg)}")
        return 0
    try:
        if args.after_job:
            schedule_evals(cfg, args.after_job, get_backend(args.backend))
            return 0
        return submit_training(args, get_backend(args.backend))
    except BackendError as exc:
        print(f"scse-launch: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
