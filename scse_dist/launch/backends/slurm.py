"""Slurm: jobs through `sbatch`, arrays through `--array=0-N%P`, checks through
`sbatch --test-only`, cancelling through `scancel`; the training script is slurm/pretrain.sh."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Optional

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources


def resource_flags(res: Resources) -> list[str]:
    """sbatch's flags for a resource request (--time, --partition and --mem only when set)."""
    flags = [f"--nodes={res.nodes}", f"--ntasks-per-node={res.tasks_per_node}",
             f"--gpus-per-node={res.gpus_per_node}", f"--cpus-per-task={res.cpus_per_task}"]
    optional = {"--time": res.time_min or None, "--partition": res.partition, "--mem": res.mem}
    return flags + [f"{flag}={value}" for flag, value in optional.items() if value is not None]


def _submit_env() -> dict[str, str]:
    """The environment sbatch runs in. Submitted from an array task (a study's training job), the
    new job would inherit the task's SLURM_ARRAY_* variables and look like an array task itself."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_ARRAY_")}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no reason given"


class SlurmBackend(Backend):
    name = "slurm"
    training_script = "slurm/pretrain.sh"

    def sbatch_args(self, job: Job, array: str = "") -> list[str]:
        """Everything after `sbatch`: flags, then the batch script and its arguments (or --wrap)."""
        logs = f"%x-%A_%a" if array else "%x-%j"
        args = [f"--array={array}"] if array else []
        args += [f"--job-name={job.name}"] if job.name else []
        if job.log_dir is not None:
            args += [f"--output={job.log_dir}/{logs}.out", f"--error={job.log_dir}/{logs}.err"]
        if job.env:
            args.append("--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in job.env.items())]))
        if job.after:
            args.append(f"--dependency={job.dependency}:{':'.join(job.after)}")
        args += self.request_flags(job) + job.extra_args
        return args + (job.command if job.script else ["--wrap", shlex.join(job.command)])

    def request_flags(self, job: Job) -> list[str]:
        return resource_flags(job.resources) if job.resources else []

    def _sbatch(self, job: Job, args: list[str]) -> str:
        if job.log_dir is not None:  # Slurm does not create it: a job without it fails at once
            Path(job.log_dir).mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                             env=_submit_env())
        if out.returncode != 0:
            raise BackendError(f"sbatch {shlex.join(args)} failed: {_last_line(out.stderr)}")
        return out.stdout.strip().split(";")[0]  # "id" or "id;cluster"

    def submit(self, job: Job) -> str:
        return self._sbatch(job, self.sbatch_args(job))

    def submit_array(self, job: Job, count: int, max_parallel: int) -> str:
        return self._sbatch(job, self.sbatch_args(job, array=f"0-{count - 1}%{max_parallel}"))

    def check(self, job: Job) -> None:
        # --test-only: Slurm says whether and when it could start the job, and submits nothing
        out = subprocess.run(["sbatch", "--test-only", *self.sbatch_args(job)], capture_output=True,
                             text=True, env=_submit_env())
        if out.returncode != 0:
            raise BackendError(_last_line(out.stderr))

    def cancel(self, job_id: str) -> None:
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True)
        if out.returncode != 0:
            raise BackendError(f"scancel {job_id} failed: {_last_line(out.stderr)}")

    def current_job(self) -> Optional[str]:
        return os.environ.get("SLURM_JOB_ID")
