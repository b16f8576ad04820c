"""Batch systems behind one protocol (base.Backend): Slurm (through submitit) and this machine."""

from __future__ import annotations

from scse_dist.launch.backends.base import Backend, BackendError, Job, Resources, Task
from scse_dist.launch.backends.local import LocalBackend
from scse_dist.launch.backends.slurm import SlurmBackend

BACKENDS: dict[str, type[Backend]] = {"slurm": SlurmBackend, "local": LocalBackend}

__all__ = ["BACKENDS", "Backend", "BackendError", "Job", "LocalBackend", "Resources",
           "SlurmBackend", "Task", "get_backend"]


def get_backend(name: str) -> Backend:
    return BACKENDS[name]()
