"""`scse-launch`: train, then evaluate and report by themselves, on Slurm or on this machine.

    scse-launch CONFIG [key.sub=value ...]                 # sbatch slurm/pretrain.sh CONFIG ...
    scse-launch CONFIG [key.sub=value ...] --local         # everything here, in this process
    scse-launch CONFIG [key.sub=value ...] --after-job ID  # only the evaluation jobs of job ID
    scse-launch CONFIG [key.sub=value ...] --evaluate      # evaluate the trained run here, then report

On Slurm, `slurm/pretrain.sh` (the training job) calls `--after-job $SLURM_JOB_ID` first thing:
that submits, through submitit, one job per task in `eval.tasks` with `--dependency=afterok:ID`
and a report job after all of them. So evaluation starts only once training succeeded; if
training fails, Slurm never starts them (a local cluster with `kill_invalid_depend` cancels
them). A requeued training job keeps its id and runs pretrain.sh again: the jobs already
scheduled for that id are recorded in `RUN/eval/scheduled.json`, so they are not submitted twice.

Every evaluation job, and `--local`, runs the same `evaluate_run`: the export's config says which
data each task reads, and `run_task` writes `RUN/eval/<task>.json`; `report_run` then writes
`RUN/eval/report.md` and `frontier.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from scse_dist.atomic import atomic_write_text
from scse_dist.cli_errors import EXIT_CONFIG, cli_main
from scse_dist.config import RunConfig, load_config

PRETRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "slurm" / "pretrain.sh"
SCHEDULED_NAME = "scheduled.json"


def task_data(cfg: RunConfig, task: str) -> str:
    """The data a task reads: the held-out shards, or the eval.wikitext / eval.lambada file."""
    return {"wikitext": cfg.eval.wikitext, "lambada": cfg.eval.lambada}.get(task) or cfg.data.path


def evaluate_run(run_dir: str, task: str) -> str:
    """Evaluate RUN/export on `task` (settings from the export's config); returns the JSON path."""
    import torch

    from scse_dist.checkpoint.loading import load_model
    from scse_dist.eval.tasks import run_task

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = load_model(Path(run_dir) / "export", device=device)
    out = str(Path(run_dir) / "eval" / f"{task}.json")
    max_batches = cfg.eval.max_batches if task in ("heldout", "diagnose") else 0
    run_task(task, model, cfg, task_data(cfg, task), cfg.eval.depths, out,
             checkpoint_label=f"{cfg.name}@export", stride=cfg.eval.stride or None,
             max_batches=max_batches)
    return out


def report_run(run_dir: str) -> str:
    from scse_dist.eval.report import report_run as write

    return write(run_dir)["report"]


def schedule_evals(cfg: RunConfig, train_job: str) -> list[str]:
    """Submit the eval jobs (afterok:train_job) and the report job; once per training job id."""
    run_dir = Path(cfg.run_dir).resolve()
    marker = run_dir / "eval" / SCHEDULED_NAME
    if marker.is_file() and json.loads(marker.read_text()).get("train_job") == str(train_job):
        print(f"scse-launch: evaluations of job {train_job} were already scheduled ({marker})")
        return []
    import submitit

    # From an array task (scse-study), sbatch would hand the eval jobs this task's SLURM_ARRAY_*
    # variables, and submitit in them would look for its files under the array task's id.
    for key in [k for k in os.environ if k.startswith("SLURM_ARRAY_")]:
        del os.environ[key]
    e = cfg.eval
    executor = submitit.AutoExecutor(folder=str(run_dir / "slurm" / "%j"), cluster="slurm")
    params = dict(timeout_min=e.slurm_time_min, cpus_per_task=e.slurm_cpus, nodes=1,
                  tasks_per_node=1, slurm_partition=e.slurm_partition)
    if e.slurm_gpus:
        params["gpus_per_node"] = e.slurm_gpus
    executor.update_parameters(name=f"{cfg.name}-eval", **params,
                               slurm_additional_parameters={"dependency": f"afterok:{train_job}"})
    jobs = [executor.submit(evaluate_run, str(run_dir), task) for task in e.tasks]
    executor.update_parameters(name=f"{cfg.name}-report", slurm_additional_parameters={
        "dependency": "afterok:" + ":".join(j.job_id for j in jobs)})
    report = executor.submit(report_run, str(run_dir))
    ids = {"train_job": str(train_job), "eval_jobs": {t: j.job_id for t, j in zip(e.tasks, jobs)},
           "report_job": report.job_id}
    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps(ids, indent=2) + "\n")
    print(f"scse-launch: after job {train_job}: eval jobs {ids['eval_jobs']}, report job "
          f"{ids['report_job']}", flush=True)
    return [*ids["eval_jobs"].values(), ids["report_job"]]


def evaluate_all(cfg: RunConfig) -> str:
    """Every task of eval.tasks that has no result yet (a requeued job repeats none), then the
    run's report. Returns report.md."""
    for task in cfg.eval.tasks:
        if not (Path(cfg.run_dir) / "eval" / f"{task}.json").is_file():
            evaluate_run(cfg.run_dir, task)
    return report_run(cfg.run_dir)


def run_local(cfg: RunConfig) -> str:
    """Train in this process, then every task of eval.tasks, then the report. Returns report.md."""
    from scse_dist.train.loop import train

    # The tasks below include held-out: the trainer's own after-train evaluation would repeat it.
    train(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, after_train=False)))
    for task in cfg.eval.tasks:
        evaluate_run(cfg.run_dir, task)
    return report_run(cfg.run_dir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scse-launch", description=__doc__.split("\n")[0])
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run everything in this process")
    where.add_argument("--after-job", metavar="JOBID",
                       help="only submit the evaluation and report jobs, afterok:JOBID")
    where.add_argument("--evaluate", action="store_true",
                       help="evaluate the trained run on every eval task here, then its report")
    p.add_argument("--sbatch-args", default="",
                   help="extra sbatch flags for the training job, e.g. '--nodes=4 --time=2-0'")
    p.add_argument("--script", help="the training batch script (default: slurm/pretrain.sh of "
                                    "this checkout, else of the current directory)")
    return p


def pretrain_script(given: str | None) -> Path:
    """The batch script to submit. pretrain.sh runs `launch/train.py` from the directory sbatch
    is called in, so a checkout is needed anyway: the package's own (an editable install), else
    the current directory's."""
    candidates = [Path(given)] if given else [PRETRAIN_SCRIPT, Path.cwd() / "slurm" / "pretrain.sh"]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"no training batch script at {' or '.join(map(str, candidates))}; run "
                            "scse-launch from the scse-dist checkout or pass --script")


@cli_main("scse-launch")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 submitted (or, --local, done); 2 bad config or no batch script; 65 bad input
    data; 66 an input missing or unreadable (--local); otherwise sbatch's status."""
    args = build_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.local:
        print(f"scse-launch: report {run_local(cfg)}")
        return 0
    if args.after_job:
        schedule_evals(cfg, args.after_job)
        return 0
    if args.evaluate:
        print(f"scse-launch: report {evaluate_all(cfg)}")
        return 0
    try:
        script = pretrain_script(args.script)
    except FileNotFoundError as exc:
        print(f"scse-launch: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    cmd = ["sbatch", *args.sbatch_args.split(), str(script), args.config, *args.overrides]
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
