"""This machine as a batch system: each job runs to its end when it is submitted, as a child
process, with its output in LOG_DIR/NAME-ID.out and .err. So dependencies are met by order: an
afterok job whose dependency failed never runs (as Slurm's kill_invalid_depend cancels it), and
an array runs its tasks one after another (within any cap). The training script is
launch/pretrain-local.sh; it reads its array task from SCSE_ARRAY_TASK_ID."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources

JOB_ID_VAR = "SCSE_LOCAL_JOB_ID"
ARRAY_TASK_VAR = "SCSE_ARRAY_TASK_ID"
_ids = itertools.count(1)


def visible_gpus() -> int:
    """GPUs this machine offers (nvidia-smi's list), without importing torch."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


class LocalBackend(Backend):
    name = "local"
    training_script = "launch/pretrain-local.sh"

    def __init__(self) -> None:
        self.exit_status: dict[str, Optional[int]] = {}  # job id -> status; None: never ran

    def _new_id(self) -> str:
        # unique across the processes of one study (a stage job submits the next stage's jobs)
        return f"{os.getpid()}.{next(_ids)}"

    def _may_run(self, job: Job) -> bool:
        """afterok: every dependency this backend ran succeeded. Ids it does not know (the job
        that submitted this one, still running) are met by order."""
        if job.dependency == "afterany":
            return True
        return all(self.exit_status.get(dep, 0) == 0 for dep in job.after)

    def _run(self, job: Job, job_id: str, task: Optional[int] = None) -> int:
        log_dir = Path(job.log_dir or ".")
        log_dir.mkdir(parents=True, exist_ok=True)
        task_id = job_id if task is None else f"{job_id}_{task}"
        name = job.name or Path(job.command[0]).stem
        stem = log_dir / f"{name}-{task_id}"
        env = {**os.environ, **job.env, JOB_ID_VAR: job_id, "SCSE_PYTHON": sys.executable}
        if task is not None:
            env[ARRAY_TASK_VAR] = str(task)
        command = ["bash", *job.command] if job.script else job.command
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            status = subprocess.run(command, stdout=out, stderr=err, env=env).returncode
        print(f"local job {task_id} ({name}) exited {status}; logs {stem}.out/.err",
              flush=True)
        return status

    def submit(self, job: Job) -> str:
        self._refuse_extra_args(job)
        job_id = self._new_id()
        self.exit_status[job_id] = self._run(job, job_id) if self._may_run(job) else None
        return job_id

    def submit_array(self, job: Job, count: int, max_parallel: int) -> str:
        self._refuse_extra_args(job)
        job_id = self._new_id()
        if not self._may_run(job):
            self.exit_status[job_id] = None
            return job_id
        statuses = [self._run(job, job_id, task) for task in range(count)]
        self.exit_status[job_id] = next((s for s in statuses if s != 0), 0)
        return job_id

    def check(self, job: Job) -> None:
        self._refuse_extra_args(job)
        res = job.resources or Resources()
        gpus, cpus = visible_gpus(), os.cpu_count() or 1
        if res.nodes != 1 or res.tasks_per_node != 1:
            raise BackendError(f"the local backend runs one task on this machine: nodes and "
                               f"tasks_per_node must be 1, got {res.nodes} and {res.tasks_per_node}")
        if res.gpus_per_node > gpus or res.cpus_per_task > cpus:
            raise BackendError(f"this machine has {gpus} GPU(s) and {cpus} CPU(s); asked for "
                               f"{res.gpus_per_node} and {res.cpus_per_task}")

    def _refuse_extra_args(self, job: Job) -> None:
        if job.extra_args:
            raise BackendError(f"the local backend takes no batch-system flags, got "
                               f"{' '.join(job.extra_args)}")

    def cancel(self, job_id: str) -> None:
        # every job submitted here has already ended: there is nothing left to stop
        if job_id not in self.exit_status:
            raise BackendError(f"no local job {job_id} was submitted by this process")

    def ended_with(self, job_id: str) -> Optional[int]:
        return self.exit_status.get(job_id)

    def current_job(self) -> Optional[str]:
        return os.environ.get(JOB_ID_VAR)

    def request_flags(self, job: Job) -> list[str]:
        res = job.resources or Resources()
        return [f"nodes={res.nodes}", f"tasks_per_node={res.tasks_per_node}",
                f"gpus_per_node={res.gpus_per_node}", f"cpus_per_task={res.cpus_per_task}"]
