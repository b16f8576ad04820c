"""What a batch system must do for `scse-launch` and `scse-study`: the whole protocol.

A backend submits a job (a command, or a batch script and its arguments, with a name, resources,
log folder, environment and dependencies), submits an array of such jobs with a cap on how many
run at once, checks a resource request before anything is submitted, and cancels a job. The
launcher and the study build `Job`s and call these methods only; what a job id looks like and how
a dependency is written are the backend's business. A new cluster type is one `Backend` subclass
plus its training batch script (see docs/architecture.md, "Where to add things").
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

# afterok: start only if every dependency succeeded (a failed one means never);
# afterany: start once every dependency ended, however it ended.
Dependency = Literal["afterok", "afterany"]


class BackendError(Exception):
    """A submission, check or cancel the batch system refused; the message is one line."""


@dataclass
class Resources:
    """What one job asks for. The study spec's `slurm:` section and the eval.slurm_* fields of a
    run config are read into this record; each backend turns it into its own request."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time_min: int = 0  # 0: the batch script's (or the cluster's) own limit
    partition: Optional[str] = None
    mem: Optional[str] = None  # e.g. 8G; None: the cluster's default


@dataclass
class Job:
    """One job. `command` is argv; with `script=True` its first item is the backend's batch script
    (whose own defaults, e.g. #SBATCH lines, apply where a field here is None)."""

    command: list[str]
    name: Optional[str] = None
    resources: Optional[Resources] = None  # None: the batch script's defaults
    log_dir: Optional[Path] = None  # None: the batch script's (or the current directory)
    after: list[str] = field(default_factory=list)  # job ids this one waits for
    dependency: Dependency = "afterok"
    env: dict[str, str] = field(default_factory=dict)  # set in the job, on top of the caller's
    script: bool = False
    extra_args: list[str] = field(default_factory=list)  # the backend's own flags (--sbatch-args)


class Backend(abc.ABC):
    """A batch system. Job ids are strings; ids from `submit_array` can be waited on as a whole."""

    name: str
    # The training batch script, relative to a checkout: it trains `CONFIG [key=value ...]` or,
    # with `--config-list FILE`, the config on the line of its array task; then, when the job's
    # SCSE_EVAL_IN_JOB is 1, evaluates the run and writes its report in the same job.
    training_script: str

    @abc.abstractmethod
    def submit(self, job: Job) -> str:
        """Submit one job; its id."""

    @abc.abstractmethod
    def submit_array(self, job: Job, count: int, max_parallel: int) -> str:
        """`count` copies of `job`, tasks 0..count-1, at most `max_parallel` running at once;
        the array's id. The batch script reads its task index from the backend's environment."""

    @abc.abstractmethod
    def check(self, job: Job) -> None:
        """BackendError (the batch system's reason, one line) if `job` could never run here."""

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None:
        """Cancel a job (or a whole array) that has not ended."""

    @abc.abstractmethod
    def current_job(self) -> Optional[str]:
        """The id of the job this process runs in, if it runs in one of this backend's jobs."""

    @abc.abstractmethod
    def request_flags(self, job: Job) -> list[str]:
        """The job's resource request as the user would write it (error messages name these)."""

    def ended_with(self, job_id: str) -> Optional[int]:
        """The job's exit status if it already ended by the time `submit` returned (a backend
        that runs jobs in place); None for a job that is queued or running, as on a cluster."""
        return None
