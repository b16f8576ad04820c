"""Running a study: in sequence on this machine (`--local`), or as Slurm job arrays (`--slurm`).

Slurm, one stage at a time, each stage submitted by a job that waits for the one before:

    sweep   sbatch --array=0-N%P slurm/pretrain.sh --config-list <study>/configs-sweep.txt
            (no evaluation jobs: SCSE_SCHEDULE_EVALS=0), then a job afterany:<array> running
            `scse-study SPEC --slurm --stage final`: it scores the sweep on lr.validation,
            writes lr_choice.json and submits stage 2. The choice needs stage 1's results, so
            stage 2 can only be submitted by a job that runs after it.
    final   the same array over the final runs; each array task schedules its own evaluation
            jobs (afterok, as `sbatch slurm/pretrain.sh` does), then a job afterany:<array>
            runs `--stage report`.
    report  cancels the evaluations of runs whose training failed (they can never run), and
            submits the study report (`python -m scse_dist.study.report STUDY_DIR`) afterany on
            the evaluation jobs still queued, or runs it at once when none are.

Finished runs are never resubmitted; unfinished ones resume from their checkpoint (train.resume
auto), so rerunning a study after an interruption repeats nothing.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from scse_dist.launch.scheduler import evaluate_run, pretrain_script
from scse_dist.study.plan import StudyError, choose_lrs, evaluate_validation, status, write_study
from scse_dist.study.spec import Run, StudySpec

REPORT_CMD = [sys.executable, "-m", "scse_dist.study.report"]


def _stages(spec: StudySpec) -> tuple[str, ...]:
    return ("sweep", "final") if spec.lr else ("final",)


def run_report(spec: StudySpec) -> int:
    """The study report, in a child process; its exit status."""
    print(f"scse-study: report: {' '.join(REPORT_CMD[1:])} {spec.study_dir}", flush=True)
    return subprocess.run([*REPORT_CMD, str(spec.study_dir)]).returncode


# --------------------------------------------------------------------------- local


def _train_and_evaluate(spec: StudySpec, run: Run) -> bool:
    """Train (resuming if a checkpoint exists) through scse-train, then the stage's evaluations."""
    if not (Path(run.run_dir) / "export").is_dir():
        train = subprocess.run([sys.executable, "-m", "scse_dist.train.cli", "--config", run.config])
        if train.returncode != 0:
            print(f"scse-study: FAILED {run.run_dir}: training exited {train.returncode}", flush=True)
            return False
    if run.stage == "sweep":
        evaluate_validation(spec, run)
    else:
        for task in spec.evals.tasks:
            if not (Path(run.run_dir) / "eval" / f"{task}.json").is_file():
                evaluate_run(run.run_dir, task)
    return True


def run_local(spec: StudySpec) -> int:
    """Every stage in sequence, finished runs skipped, then the report. 1 if a run failed."""
    failed = []
    for stage in _stages(spec):
        if stage == "final" and spec.lr:
            print(f"scse-study: chosen learning rates {choose_lrs(spec)}", flush=True)
        for run in write_study(spec, stage):
            state = status(spec, run)
            if state == "done":
                print(f"scse-study: done, skipped: {run.run_dir}", flush=True)
                continue
            print(f"scse-study: {'resuming' if state == 'partial' else 'starting'} {run.run_dir}",
                  flush=True)
            if not _train_and_evaluate(spec, run):
                failed.append(run.run_dir)
    report = run_report(spec)
    if failed:
        print(f"scse-study: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or report else 0


# --------------------------------------------------------------------------- slurm


def _sbatch(args: list[str]) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise StudyError(f"sbatch {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def _next_job(spec: StudySpec, stage: str, after: list[str], cli_args: list[str]) -> str:
    """A small job, afterany on `after`, that runs `scse-study SPEC --slurm --stage <stage>`."""
    cmd = [sys.executable, "-m", "scse_dist.study.cli", *cli_args, "--stage", stage]
    logs = spec.study_dir.resolve() / "slurm"
    return _sbatch([f"--job-name={spec.name}-{stage}", "--ntasks=1", "--cpus-per-task=1",
                    f"--output={logs}/%x-%j.out", *([f"--dependency=afterany:{':'.join(after)}"]
                                                   if after else []),
                    "--wrap", shlex.join(cmd)])


def submit_stage(spec: StudySpec, stage: str, max_parallel: int, sbatch_args: list[str],
                 cli_args: list[str]) -> dict:
    """Submit one stage's unfinished runs as an array (cap `max_parallel`) and the job that
    continues after it; returns {"array": id or None, "next": id, "runs": [...]}."""
    if stage == "final" and spec.lr:
        print(f"scse-study: chosen learning rates {choose_lrs(spec)}", flush=True)
    runs = [r for r in write_study(spec, stage) if status(spec, r) != "done"]
    following = "final" if stage == "sweep" else "report"
    logs = spec.study_dir.resolve() / "slurm"
    logs.mkdir(parents=True, exist_ok=True)
    array = None
    if runs:
        listing = spec.study_dir / f"configs-{stage}.txt"
        listing.write_text("".join(str(Path(r.config).resolve()) + "\n" for r in runs))
        env = ["--export=ALL,SCSE_SCHEDULE_EVALS=0"] if stage == "sweep" else []
        array = _sbatch([f"--array=0-{len(runs) - 1}%{max_parallel}", f"--job-name={spec.name}-{stage}",
                         f"--output={logs}/%x-%A_%a.out", f"--error={logs}/%x-%A_%a.err", *env,
                         *sbatch_args, str(pretrain_script(None)), "--config-list",
                         str(listing.resolve())])
        print(f"scse-study: stage {stage}: array job {array} of {len(runs)} run(s), at most "
              f"{max_parallel} at once", flush=True)
    nxt = _next_job(spec, following, [array] if array else [], cli_args)
    print(f"scse-study: stage {following}: job {nxt} after {array or 'nothing'}", flush=True)
    ids = {"stage": stage, "array": array, "next": nxt, "runs": [r.run_dir for r in runs]}
    (logs / f"{stage}.json").write_text(json.dumps(ids, indent=2) + "\n")
    return ids


def _queued(job_ids: list[str]) -> list[str]:
    """The ids among `job_ids` that Slurm still has pending or running."""
    if not job_ids:
        return []
    out = subprocess.run(["squeue", "-h", "-t", "PD,R,CG", "-o", "%i", "-j", ",".join(job_ids)],
                         capture_output=True, text=True)
    return [j for j in out.stdout.split() if j in job_ids]


def submit_report(spec: StudySpec) -> str | None:
    """After the final array: the report job, afterany on the evaluations still queued."""
    waiting, hopeless = [], []
    for run in write_study(spec, "final"):
        marker = Path(run.run_dir) / "eval" / "scheduled.json"
        if not marker.is_file():
            continue
        ids = json.loads(marker.read_text())
        jobs = [*ids["eval_jobs"].values(), ids["report_job"]]
        trained = (Path(run.run_dir) / "export").is_dir()
        (waiting if trained else hopeless).extend(jobs)
        if not trained:
            print(f"scse-study: FAILED {run.run_dir}: training did not finish (job "
                  f"{ids['train_job']}); its evaluations are cancelled", flush=True)
    if _queued(hopeless):
        subprocess.run(["scancel", *_queued(hopeless)])
    waiting = _queued(waiting)
    if not waiting:
        return None
    logs = spec.study_dir.resolve() / "slurm"
    return _sbatch([f"--job-name={spec.name}-study-report", "--ntasks=1", "--cpus-per-task=1",
                    f"--output={logs}/%x-%j.out", f"--dependency=afterany:{':'.join(waiting)}",
                    "--wrap", shlex.join([*REPORT_CMD, str(spec.study_dir.resolve())])])


def run_slurm(spec: StudySpec, stage: str, max_parallel: int, sbatch_args: list[str],
              cli_args: list[str]) -> int:
    if stage == "auto":
        stage = "final" if not spec.lr or (spec.study_dir / "lr_choice.json").is_file() else "sweep"
    if stage == "report":
        job = submit_report(spec)
        if job:
            print(f"scse-study: study report job {job}", flush=True)
            return 0
        return run_report(spec)
    submit_stage(spec, stage, max_parallel, sbatch_args, cli_args)
    return 0
