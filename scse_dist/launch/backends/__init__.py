"""Batch systems behind one protocol (base.Backend): Slurm (through submitit) and this machine."""

from __future__ import annotations

from typing import Optional

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources, Task
from scse_dist.launch.backends.local import LocalBackend
from scse_dist.launch.backends.slurm import SlurmBackend

BACKENDS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}

__all__ = ["BACKENDS", "Backend", "BackendError", "Job", "LocalBackend", "Resources",
           "SlurmBackend", "Task", "current_backend", "get_backend"]


def get_backend(name: str) -> Backend:
    return BACKENDS[name]()


def current_backend() -> Optional[tuple[Backend, str]]:
    """The backend whose job this process runs in, and the job's id; None outside any job. The
    local backend first: its job variable is set for its own children only, so a local job
    inside a Slurm allocation is the local backend's."""
    for name in ("local", "slurm"):
        backend = get_backend(name)
        job_id = backend.current_job()
        if job_id:
            return backend, job_id
    return None
