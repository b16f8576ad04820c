"""This machine as a batch system: each job runs to its end when submitted, as a child process
(scse_dist.launch.children), output in LOG_DIR/NAME-ID.out and .err. Dependencies are met by
order (an afterok job whose dependency failed never runs); an array's tasks run one by one. A
job a signal stopped stops the submitting command too (StoppedBySignal); a rerun resumes.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.launch.backends.base import Backend, BackendError, Job, Task
from scse_dist.launch.children import StoppedBySignal, run_child

JOB_ID_VAR = "SCSE_LOCAL_JOB_ID"
_ids = itertools.count(1)


def visible_gpus() -> int:
    """GPUs this machine offers (nvidia-smi's list), without importing torch."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


class LocalBackend(Backend):
    name = "local"
    runs_in_place = True

    def __init__(self) -> None:
        self.exit_status: dict[str, Optional[int]] = {}  # job id -> status; None: never ran

    def _run(self, job: Job, command: list[str], job_id: str) -> int:
        Path(job.log_dir).mkdir(parents=True, exist_ok=True)
        name = job.name or "job"
        stem = Path(job.log_dir) / f"{name}-{job_id}"
        env = {**os.environ, **job.env, JOB_ID_VAR: job_id}
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            ended = run_child(command, env=env, stdout=out, stderr=err)
        print(f"local job {job_id} ({name}) exited {ended.status}; logs {stem}.out/.err",
              flush=True)
        if ended.signal_name:
            self.exit_status[job_id] = ended.status
            raise StoppedBySignal(ended.signal_name, ended.status, f"local job {job_id} ({name})")
        return ended.status

    def submit(self, job: Job) -> str:
        return self._submit(job, {"": job.command})

    def submit_array(self, job: Job, tasks: Sequence[Task], max_parallel: int) -> str:
        return self._submit(job, {f"_{i}": task.command for i, task in enumerate(tasks)})

    def _submit(self, job: Job, commands: dict[str, list[str]]) -> str:
        """Run each command (keyed by its id's suffix) in turn; the job fails as its first does."""
        self._refuse_backend_args(job)
        # unique across the processes of one study (a stage job submits the next stage's jobs)
        job_id = f"{os.getpid()}.{next(_ids)}"
        self.exit_status[job_id] = None
        # afterok: every dependency this backend ran succeeded (others are met by order)
        if job.dependency == "afterany" or all(self.exit_status.get(d, 0) == 0 for d in job.after):
            statuses = [self._run(job, command, job_id + suffix)
                        for suffix, command in commands.items()]
            self.exit_status[job_id] = next((s for s in statuses if s != 0), 0)
        return job_id

    def check(self, job: Job) -> None:
        self._refuse_backend_args(job)
        res = job.resources
        gpus, cpus = visible_gpus(), os.cpu_count() or 1
        if res.nodes != 1 or res.tasks_per_node != 1:
            raise BackendError(f"the local backend runs one task on this machine: nodes and "
                               f"tasks_per_node must be 1, got {res.nodes} and "
                               f"{res.tasks_per_node}")
        if res.gpus_per_node > gpus or res.cpus_per_task > cpus:
            raise BackendError(f"this machine has {gpus} GPU(s) and {cpus} CPU(s); asked for "
                               f"{res.gpus_per_node} and {res.cpus_per_task}")

    def _refuse_backend_args(self, job: Job) -> None:
        if job.backend_args:
            raise BackendError(f"the local backend takes no --backend-args, got "
                               f"{' '.join(job.backend_args)}")

    def cancel(self, job_id: str) -> None:
        # every job submitted here has already ended: there is nothing left to stop
        if job_id not in self.exit_status:
            raise BackendError(f"no local job {job_id} was submitted by this process")

    def ended_with(self, job_id: str) -> Optional[int]:
        return self.exit_status.get(job_id)

    def current_job(self) -> Optional[str]:
        return os.environ.get(JOB_ID_VAR)

    def request_flags(self, job: Job) -> list[str]:
        res = job.resources
        return [f"nodes={res.nodes}", f"tasks_per_node={res.tasks_per_node}",
                f"gpus_per_node={res.gpus_per_node}", f"cpus_per_task={res.cpus_per_task}"]
