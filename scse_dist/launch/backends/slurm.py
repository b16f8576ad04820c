"""Slurm through submitit: each job a `SlurmTask` run in every task under srun, arrays a batch
submission capped by `array_parallelism`; logs and pickles go to the job's log_dir, which the
nodes must share.

Preemption: SIGUSR1 120 s before the time limit; the trainer saves and exits 75, and task 0's
SlurmTask requeues the job, whose next start resumes from the checkpoint (submitit's own
checkpointing is not used: the state to save is the trainer's).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources, Task
from scse_dist.launch.children import REQUEUE_EXIT_CODE, run_child

PREEMPT_SIGNAL = "USR1@120"  # what scse_dist.train.faults saves on, and how early
# The files a submission writes into its log_dir (submitit's names): a refused one removes its own.
SUBMISSION_FILES = ("*_submission.sh", "*.pkl", ".submission_file_*")


def resource_parameters(res: Resources) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for a request (the cluster's defaults where unasked)."""
    params: dict[str, Any] = {"nodes": res.nodes, "ntasks_per_node": res.tasks_per_node,
                              "cpus_per_task": res.cpus_per_task, "time": res.time_min or None}
    optional = {"gpus_per_node": res.gpus_per_node or None, "partition": res.partition,
                "mem": res.mem}
    return {**params, **{k: v for k, v in optional.items() if v is not None}}


def flag_parameters(flags: Sequence[str]) -> dict[str, Any]:
    """--backend-args for sbatch (`--key=value` or `--key`) as submitit's additional_parameters."""
    params: dict[str, Any] = {}
    for flag in flags:
        if not flag.startswith("--") or len(flag) < 3:
            raise BackendError(f"--backend-args: {flag!r}: Slurm flags are given as --name=value "
                               "or --name")
        key, eq, value = flag[2:].partition("=")
        params[key.replace("-", "_")] = value if eq else True
    return params


@contextlib.contextmanager
def _submission_env() -> Iterator[None]:
    """sbatch runs with this process's environment. Submitted from an array task, the new job
    would inherit its SLURM_ARRAY_* variables and look like an array task to submitit."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_ARRAY_")}
    try:
        yield
    finally:
        os.environ.update(saved)


class SlurmTask:
    """What each task of a Slurm job runs (pickled by submitit): the job's command, signals
    forwarded; status 75 requeues the job (task 0 does). `name`: an array task's, once started."""

    def __init__(self, command: list[str], env: dict[str, str], name: Optional[str]) -> None:
        self.command, self.env, self.name = command, env, name

    def __call__(self) -> int:
        import submitit

        job_env = submitit.JobEnvironment()
        if job_env.global_rank == 0 and self.name:
            # an array's tasks share one name until they start (an array of one is a plain job)
            subprocess.run(["scontrol", "update", f"JobId={job_env.job_id}",
                            f"JobName={self.name}"], check=False)
        ended = run_child(self.command, env={**os.environ, **self.env})
        if ended.status == REQUEUE_EXIT_CODE and job_env.global_rank != 0:
            return 0  # task 0 requeues the job; a failure here would end task 0 first (srun)
        if ended.status == REQUEUE_EXIT_CODE:
            print(f"slurm backend: the job's command exited 75 (preempted and saved, or its run "
                  f"dir still held by another job); requeueing job {job_env.job_id}", flush=True)
            try:
                job_env._requeue(countdown=0)  # submitit's requeue: scontrol requeue <job id>
            except (subprocess.SubprocessError, OSError) as exc:  # e.g. the job was cancelled
                print(f"slurm backend: requeue failed: {exc}", file=sys.stderr, flush=True)
            return ended.status
        if ended.status:
            sys.stdout.flush()
            raise SystemExit(ended.status)  # the job ends with the command's own status
        return 0


@contextlib.contextmanager
def _undone_on_failure(folder: Path) -> Iterator[None]:
    """A submission that raises removes the submitit files it wrote into `folder` (those that were
    not there before), and the folders it created (`folder` and its missing parents) left empty."""
    made = [d for d in (folder, *folder.parents) if not d.exists()]
    before = set() if made else set(os.listdir(folder))
    try:
        yield
    except BaseException:
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name not in before and path.is_file() and \
                        any(path.match(pattern) for pattern in SUBMISSION_FILES):
                    path.unlink()
        for path in made:  # deepest first
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


class SlurmBackend(Backend):
    name = "slurm"
    requeues = True

    def __init__(self) -> None:
        self._submitted: dict[str, Path] = {}  # job id -> its submitit folder, for cancel

    def parameters(self, job: Job, array_parallelism: Optional[int] = None) -> dict[str, Any]:
        """`job`'s SlurmExecutor parameters, --backend-args last (they win)."""
        extra: dict[str, Any] = {"signal": PREEMPT_SIGNAL, "requeue": True}
        if job.after:
            extra["dependency"] = f"{job.dependency}:{':'.join(job.after)}"
        extra.update(flag_parameters(job.backend_args))
        params = {**resource_parameters(job.resources), "additional_parameters": extra,
                  # one rank's failure ends the step at once instead of leaving the others waiting
                  "srun_args": ["--kill-on-bad-exit=1"]}
        if job.name:
            params["job_name"] = job.name
        if array_parallelism is not None:
            params["array_parallelism"] = array_parallelism
        return params

    def _executor(self, job: Job, array_parallelism: Optional[int] = None):
        import submitit

        try:
            executor = submitit.SlurmExecutor(folder=Path(job.log_dir).resolve(), max_num_timeout=0)
            executor.update_parameters(**self.parameters(job, array_parallelism))
        except (RuntimeError, ValueError) as exc:  # no srun here; a parameter submitit refuses
            raise BackendError(f"slurm: {' '.join(str(exc).split())}") from None
        return executor

    def submit(self, job: Job) -> str:
        folder = Path(job.log_dir).resolve()
        with _undone_on_failure(folder), self._errors(), _submission_env():
            executor = self._executor(job)
            submitted = executor.submit(SlurmTask(job.command, job.env, None))  # named already
        self._submitted[submitted.job_id] = executor.folder
        return submitted.job_id

    def submit_array(self, job: Job, tasks: Sequence[Task], max_parallel: int) -> str:
        folder = Path(job.log_dir).resolve()
        with _undone_on_failure(folder), self._errors(), _submission_env():
            executor = self._executor(job, array_parallelism=max_parallel)
            with executor.batch():  # one sbatch --array on leaving the block
                jobs = [executor.submit(SlurmTask(t.command, job.env, t.name)) for t in tasks]
        array_id = jobs[0].job_id.split("_")[0]  # task i is <array id>_<i>
        self._submitted[array_id] = executor.folder
        return array_id

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        import submitit

        try:
            yield
        except submitit.core.utils.FailedJobError as exc:
            raise BackendError(f"sbatch failed: {_last_line(str(exc))}") from None

    def check(self, job: Job) -> None:
        # sbatch --test-only on the script submitit would submit: nothing is submitted
        from submitit.slurm.slurm import _make_sbatch_string

        executor = self._executor(job)
        text = _make_sbatch_string(command="true", folder=executor.folder, **executor.parameters)
        with tempfile.NamedTemporaryFile("w", suffix=".sh") as script, _submission_env():
            script.write(text)
            script.flush()
            out = subprocess.run(["sbatch", "--test-only", script.name], capture_output=True,
                                 text=True)
        if out.returncode != 0:
            raise BackendError(_last_line(out.stderr))

    def cancel(self, job_id: str) -> None:
        import submitit

        if job_id not in self._submitted:
            raise BackendError(f"no Slurm job {job_id} was submitted by this process")
        try:  # an array's id cancels all its tasks
            submitit.SlurmJob(folder=self._submitted[job_id], job_id=job_id).cancel(check=True)
        except subprocess.CalledProcessError as exc:
            raise BackendError(f"scancel {job_id} failed: exit {exc.returncode}") from None

    def current_job(self) -> Optional[str]:
        return os.environ.get("SLURM_JOB_ID")

    def current_start(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT") or 0)

    def requeue(self, job_id: str) -> None:
        # what submitit's requeue runs too; the job needs --requeue (every job here asks for it)
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if out.returncode != 0:
            raise BackendError(f"scontrol requeue {job_id} failed: {_last_line(out.stderr)}")

    def request_flags(self, job: Job) -> list[str]:
        params = resource_parameters(job.resources)
        return [f"--{k.replace('_', '-')}={v}" for k, v in params.items() if v is not None] + \
            list(job.backend_args)
