"""Intra-op threads for a command on CPU: enough to use the free cores, never more.

torch's busy-waiting OpenMP threads fight another busy process for the cores, so a command takes
the cores free now (usable CPUs less the 1-minute load average, shared by this node's processes),
at least one. `OMP_NUM_THREADS` set by the user wins, and so does `threads` when passed.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

THREADS_ENV = "OMP_NUM_THREADS"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a Slurm allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def choose_threads(cpus: int, load: float, local_processes: int = 1,
                   env: Optional[Mapping[str, str]] = None) -> int:
    """The thread count for one of `local_processes` processes on `cpus` CPUs under `load`."""
    env = os.environ if env is None else env
    raw = env.get(THREADS_ENV, "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    free = cpus - int(round(load))
    return max(1, free // max(1, local_processes))


def configure_threads(threads: Optional[int] = None, local_processes: Optional[int] = None) -> int:
    """Set torch's intra-op threads for this command (see the module docstring); returns it."""
    import torch

    if threads is None:
        if local_processes is None:
            local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        threads = choose_threads(usable_cpus(), load, local_processes)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
