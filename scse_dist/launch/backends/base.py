"""What a batch system must do for `scse-launch` and `scse-study`: submit a job, an array with a
cap, check a request, cancel. Callers build `Job`s and call these methods only; every command a
job runs is an installed entry point. A new cluster type is one `Backend` subclass
(docs/architecture.md, "A batch system").
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

from scse_dist.resources import Resources

# afterok: only if every dependency succeeded (else never); afterany: once every one ended
Dependency = Literal["afterok", "afterany"]

class BackendError(Exception):
    """A submission, check or cancel the batch system refused; the message is one line."""


@dataclass
class Job:
    """One job: `command` (argv) runs in each of its tasks (nodes x tasks_per_node)."""

    command: list[str]
    name: Optional[str] = None
    resources: Resources = field(default_factory=Resources)
    log_dir: Path = Path("logs")  # the job's output; made when the job is submitted
    after: list[str] = field(default_factory=list)  # job ids this one waits for
    dependency: Dependency = "afterok"
    env: dict[str, str] = field(default_factory=dict)  # set in the job, on top of the caller's
    backend_args: list[str] = field(default_factory=list)


@dataclass
class Task:
    """One task of an array: its command, and the name it shows once it runs (where it can)."""

    command: list[str]
    name: Optional[str] = None


class Backend(abc.ABC):
    """A batch system. Job ids are strings; ids from `submit_array` can be waited on as a whole."""

    name: str
    runs_in_place: bool = False  # a job runs to its end in submit(): evaluate inside the job
    requeues: bool = False  # requeue() works: a crashed training job is retried (retries.py)

    @abc.abstractmethod
    def submit(self, job: Job) -> str:
        """Submit one job; its id."""

    @abc.abstractmethod
    def submit_array(self, job: Job, tasks: Sequence[Task], max_parallel: int) -> str:
        """An array like `job`, task i running tasks[i].command, `max_parallel` at once; its id."""

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

    def current_start(self) -> int:
        """How many times the job this process runs in was requeued before this start."""
        return 0

    def requeue(self, job_id: str) -> None:
        """Put job `job_id` back in the queue, to start again under the same id."""
        raise BackendError(f"the {self.name} backend cannot requeue a job")

    def ended_with(self, job_id: str) -> Optional[int]:
        """The job's exit status if it ended within `submit`; None if queued or running."""
        return None
