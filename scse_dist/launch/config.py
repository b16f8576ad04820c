"""The `launch:` section: what scse-launch does with the run's training job besides asking for
its `resources:` (scse_dist.launch.run_job reads it; training never does). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchConfig:
    # Requeues of a crashed training job (any exit but 0, 2, 3, 4, 65, 66, 75, 130) on a batch
    # system that can (Slurm); the same failure at the same step twice stops sooner. 0: never.
    max_retries: int = field(default=2, metadata={"ge": 0})
