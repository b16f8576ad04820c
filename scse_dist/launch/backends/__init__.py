"""Batch systems behind one protocol (base.Backend): Slurm (through submitit) and this machine."""

from __future__ import annotations

from typing import Optional

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources, Task
from scse_dist.launch.backends.local import LocalBackend
from scse_dist.launch.backends.slurm import SlurmBackend

# in the order current_backend() asks: the local job variable is set for its own children only,
# so a local job inside a Slurm allocation is the local backend's
BACKENDS: dict[str, type[Backend]] = {"local": LocalBackend, "slurm": SlurmBackend}

__all__ = ["BACKENDS", "Backend", "BackendError", "Job", "LocalBackend", "Resources",
           "SlurmBackend", "Task", "current_backend", "get_backend"]


def get_backend(name: str) -> Backend:
    return BACKENDS[name]()


def current_backend() -> Optional[tuple[Backend, str]]:
    """The backend whose job this process runs in (asked in BACKENDS' order) and the job's id."""
    for name in BACKENDS:
        backend = get_backend(name)
        job_id = backend.current_job()
        if job_id:
            return backend, job_id
    return None
