"""A batch system that runs nothing: it records every call the launcher and the study make
through the backend protocol (scse_dist.launch.backends.base.Backend), so a test can assert
which jobs, arrays, caps and dependencies they ask for without any batch system."""

from __future__ import annotations

from typing import Optional, Sequence

from scse_dist.launch.backends import Backend, BackendError, Job, Task


class RecordingBackend(Backend):
    name = "recording"

    def __init__(self, refuse: str = "", fail_submit_at: Optional[int] = None,
                 current: Optional[str] = None) -> None:
        self.calls: list[tuple] = []  # ("submit", job, id) / ("array", job, tasks, cap, id) / ...
        self.refuse = refuse  # check() raises with this reason when set
        self.fail_submit_at = fail_submit_at  # the n-th submit (0-based) raises
        self.current = current
        self._submits = 0

    def _next_id(self) -> str:
        return str(100 + len([c for c in self.calls if c[0] in ("submit", "array")]))

    def submit(self, job: Job) -> str:
        if self._submits == self.fail_submit_at:
            raise BackendError("queue is full")
        self._submits += 1
        job_id = self._next_id()
        self.calls.append(("submit", job, job_id))
        return job_id

    def submit_array(self, job: Job, tasks: Sequence[Task], max_parallel: int) -> str:
        job_id = self._next_id()
        self.calls.append(("array", job, list(tasks), max_parallel, job_id))
        return job_id

    def check(self, job: Job) -> None:
        self.calls.append(("check", job))
        if self.refuse:
            raise BackendError(self.refuse)

    def cancel(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))

    def current_job(self) -> Optional[str]:
        return self.current

    def request_flags(self, job: Job) -> list[str]:
        res = job.resources
        return [f"nodes={res.nodes}", f"gpus={res.gpus_per_node}", *job.backend_args]

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]
