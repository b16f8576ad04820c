"""What a job asks of a batch system: the `resources:` section of a run config and of a study
spec, and `eval.resources`. A leaf below the launcher, the eval section and the study, which all
ask for jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Resources:
    """What one job (training, evaluation, a study's run) asks of a batch system, on any backend."""

    nodes: int = 1
    tasks_per_node: int = 1  # one training process each (one per GPU on a GPU node)
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time_min: int = 0  # 0: no limit asked for (the cluster's own)
    partition: Optional[str] = None  # None: the cluster's default
    mem: Optional[str] = None  # e.g. 8G; None: the cluster's default

    def problem(self) -> Optional[str]:
        """What is wrong with the request, named by its fields, or None."""
        if min(self.nodes, self.tasks_per_node, self.cpus_per_task) < 1:
            return "nodes, tasks_per_node and cpus_per_task must be >= 1"
        if min(self.gpus_per_node, self.time_min) < 0:
            return "gpus_per_node and time_min must be >= 0"
        return None


@dataclass
class EvalResources(Resources):
    time_min: int = 120  # an evaluation job's limit: one task on one node, two hours
