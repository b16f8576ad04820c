"""Running a study: in sequence on this machine (`--local`), or as job arrays on a batch system
(`--backend NAME`, `--slurm` for `--backend slurm`), through scse_dist.launch.backends only.

On a batch system one stage at a time: an array over the stage's unfinished runs (final runs
evaluated inside their own job), then a job afterany on it running `scse-study ... --stage NEXT`
(choose the rates and submit the final array; or name the failed runs and report): why so,
docs/studies.md. Finished runs are never rerun, unfinished ones resume from their checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch.backends import Backend, BackendError, Job, Task
from scse_dist.launch.children import StoppedBySignal, run_child, stop_on_signals
from scse_dist.launch.retries import CrashWatch
from scse_dist.launch.scheduler import LOGS, training_command
from scse_dist.progress import eta_seconds, format_duration
from scse_dist.resources import Resources
from scse_dist.run_dir import RunDir
from scse_dist.study.plan import StudyError, choose_lrs, recorded_runs, status, write_study
from scse_dist.study.runs import Run
from scse_dist.study.spec import StudySpec
from scse_dist.study.validation import score_finished, sweep_score

REPORT_CMD = [sys.executable, "-m", "scse_dist.study.report_cli", "--study"]


def run_report(spec: StudySpec) -> int:
    """The validation stage (each finished final run scored on the spec's validation text), then
    the study report over every run of runs.json, in a child process; its exit status."""
    score_finished(spec, recorded_runs(spec))
    print(f"scse-study: report: {' '.join(REPORT_CMD[1:])} {spec.study_dir}", flush=True)
    ended = run_child([*REPORT_CMD, str(spec.study_dir)])
    if ended.signal_name:
        raise StoppedBySignal(ended.signal_name, ended.status, "the study report")
    return ended.status


# A bad config (2), bad input data (65) or a missing input (66): every run that reads the same
# input fails the same way, so a study whose first runs all fail alike stops there.
INPUT_EXITS = (2, 65, 66)
FAIL_FAST_AFTER = 2


def _train(run: Run) -> tuple[int, str]:
    """scse-train on the run's config (resuming a checkpoint), its stderr passed on; (exit status,
    last stderr line). StoppedBySignal once a signal forwarded to it made it save and exit."""
    watch = CrashWatch()
    ended = run_child([sys.executable, "-m", "scse_dist.train.cli", "--config", run.config],
                      on_stderr_line=watch)
    if ended.signal_name:
        raise StoppedBySignal(ended.signal_name, ended.status, f"training {run.run_dir}")
    return ended.status, watch.last


def _train_and_evaluate(spec: StudySpec, run: Run) -> tuple[int, str]:
    """Train through scse-train, then the stage's evaluations; (0, "") or training's failure."""
    if not RunDir(run.run_dir).export.is_dir():
        code, line = _train(run)
        if code != 0:
            print(f"scse-study: FAILED {run.run_dir}: training exited {code}", flush=True)
            return code, line
    if run.stage == "sweep":
        sweep_score(spec, run)
    else:
        for task in spec.evals.tasks:
            if not RunDir(run.run_dir).evaluated(task):
                evaluate_export(run.run_dir, task)
    return 0, ""


def run_local(spec: StudySpec) -> int:
    """Every stage in sequence, finished runs skipped, then the report. 1 if a run failed; the
    runs' exit status when the first ones all failed on the same input error (then it stops)."""
    doing = ["the study"]
    with stop_on_signals(lambda: doing[0]):
        return _run_local(spec, doing)


def _run_local(spec: StudySpec, doing: list[str]) -> int:
    failed, outcomes = [], []
    for stage in ("sweep", "final") if spec.lr else ("final",):
        if stage == "final" and spec.lr:
            print(f"scse-study: chosen learning rates {choose_lrs(spec)}", flush=True)
        runs = write_study(spec, stage)
        todo = [run for run in runs if status(spec, run) != "done"]
        print(f"scse-study: {stage} stage: {len(runs) - len(todo)} of {len(runs)} runs done, "
              f"{len(todo)} to run", flush=True)
        start = time.perf_counter()
        for i, run in enumerate(todo):
            elapsed = time.perf_counter() - start
            state = status(spec, run)
            print(f"scse-study: [{i + 1}/{len(todo)} {stage}] "
                  f"{'resuming' if state == 'partial' else 'starting'} {run.run_dir} (elapsed "
                  f"{format_duration(elapsed)}, "
                  f"ETA {format_duration(eta_seconds(i, len(todo), elapsed))})",
                  flush=True)
            doing[0] = f"the evaluation of {run.run_dir}"  # (training is a child: forwarded)
            outcome = _train_and_evaluate(spec, run)
            doing[0] = "the study"
            outcomes.append(outcome)
            if outcome[0] != 0:
                failed.append(run.run_dir)
            # the first runs of this invocation all failed on the same input error
            if len(outcomes) >= FAIL_FAST_AFTER and len(set(outcomes)) == 1 and \
                    outcome[0] in INPUT_EXITS:
                print(f"scse-study: stopped: the first {len(outcomes)} runs failed alike (exit "
                      f"{outcome[0]}): {outcome[1]}", file=sys.stderr)
                return outcome[0]
    report = run_report(spec)
    if failed:
        print(f"scse-study: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or report else 0


def _next_job(spec: StudySpec, stage: str, after: list[str], cli_args: list[str]) -> Job:
    """A small job, afterany on `after`, that runs `scse-study SPEC --backend B --stage <stage>`."""
    cmd = [sys.executable, "-m", "scse_dist.study.cli", *cli_args, "--stage", stage]
    # named for what it does: "-final" is the final array's own name
    name = f"{spec.name}-{'choose-lr' if stage == 'final' else stage}"
    return Job(command=cmd, name=name, resources=Resources(partition=spec.resources.partition),
               log_dir=spec.study_dir.resolve() / LOGS, after=after, dependency="afterany",
               env={"SCSE_STUDY_STAGE_JOB": "1"})


def check_request(backend: Backend, job: Job) -> None:
    """StudyError naming the request when the batch system says it could never run `job`."""
    try:
        backend.check(job)
    except BackendError as exc:
        asked = " ".join(backend.request_flags(job))
        raise StudyError(f"the cluster cannot run the training jobs as requested ({asked}; "
                         f"spec field resources and --backend-args): {exc}") from None


def training_array(spec: StudySpec, stage: str, runs: list[Run], backend: Backend,
                   backend_args: list[str]) -> tuple[Job, list[Task]]:
    """A stage's array job and its tasks (run_job train, evaluating in the final stage)."""
    # Submitted by a stage job: start after it ended, so that it never runs beside the array.
    me = backend.current_job() if os.environ.get("SCSE_STUDY_STAGE_JOB") else None
    job = Job(command=[], name=f"{spec.name}-{stage}", resources=spec.resources,
              log_dir=spec.study_dir.resolve() / LOGS, after=[me] if me else [],
              dependency="afterany", backend_args=backend_args)
    # each task takes its run's name once it starts: study, variant, (rate,) seed
    tasks = [Task(training_command(r.config, [], evaluate=stage == "final"),
                  f"{spec.name}-{Path(r.run_dir).name}") for r in runs]
    return job, tasks


def submit_stage(spec: StudySpec, stage: str, max_parallel: int, backend: Backend,
                 backend_args: list[str], cli_args: list[str]) -> dict:
    """Submit one stage's unfinished runs as an array and the job continuing after it (if that
    fails, the array is cancelled); returns the ids, also written to logs/<stage>.json."""
    if stage == "final" and spec.lr:
        print(f"scse-study: chosen learning rates {choose_lrs(spec)}", flush=True)
    runs = [r for r in write_study(spec, stage) if status(spec, r) != "done"]
    following = "final" if stage == "sweep" else "report"
    logs = spec.study_dir.resolve() / LOGS
    logs.mkdir(parents=True, exist_ok=True)
    array = None
    if runs:
        job, tasks = training_array(spec, stage, runs, backend, backend_args)
        check_request(backend, job)
        array = backend.submit_array(job, tasks, max_parallel)
        print(f"scse-study: stage {stage}: array job {array} of {len(runs)} run(s), at most "
              f"{max_parallel} at once, each evaluated in its own job", flush=True)
    try:
        nxt = backend.submit(_next_job(spec, following, [array] if array else [], cli_args))
    except BackendError:
        if array:
            backend.cancel(array)
        raise
    print(f"scse-study: stage {following}: job {nxt} after {array or 'nothing'}", flush=True)
    ids = {"stage": stage, "array": array, "next": nxt, "runs": [r.run_dir for r in runs]}
    (logs / f"{stage}.json").write_text(json.dumps(ids, indent=2) + "\n")
    return ids


def report_failures(spec: StudySpec) -> int:
    """After the final array: one line for each run that did not finish; how many."""
    failed = 0
    for run in write_study(spec, "final"):
        if status(spec, run) != "done":
            trained = RunDir(run.run_dir).export.is_dir()
            what = "its evaluation did not finish" if trained else "training did not finish"
            print(f"scse-study: FAILED {run.run_dir}: {what}", flush=True)
            failed += 1
    return failed


def run_submitted(spec: StudySpec, stage: str, max_parallel: int, backend: Backend,
                  backend_args: list[str], cli_args: list[str]) -> int:
    """One step on a batch system: submit a stage, or (the last job) name failures and report."""
    if stage == "auto":
        stage = "final" if not spec.lr or (spec.study_dir / "lr_choice.json").is_file() else "sweep"
    if stage == "report":  # a failed run fails the report job (Slurm shows it FAILED)
        failed = report_failures(spec)
        return 1 if run_report(spec) or failed else 0
    try:
        ids = submit_stage(spec, stage, max_parallel, backend, backend_args, cli_args)
    except BackendError as exc:
        raise StudyError(str(exc)) from None
    # a backend that ran the whole chain in place (local) says how it ended: a failed run fails us
    ended = backend.ended_with(ids["next"])
    if ended and backend.current_job() is None:  # the user's own command: name the failures
        report_failures(spec)
    return ended or 0
