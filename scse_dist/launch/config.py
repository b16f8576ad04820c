"""The `launch:` section: what scse-launch does with the run's training job besides asking for
its `resources:` (scse_dist.launch.run_job reads it; training never does). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from scse_dist.typed_yaml import ConfigError


@dataclass
class LaunchConfig:
    # Requeues of a crashed training job (any exit but 0, 2, 3, 4, 65, 66, 75, 130) on a batch
    # system that can (Slurm); the same failure at the same step twice stops sooner. 0: never.
    max_retries: int = 2

    def check(self) -> None:
        if self.max_retries < 0:
            raise ConfigError(f"launch.max_retries: must be >= 0, got {self.max_retries}")
