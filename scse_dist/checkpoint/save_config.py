"""train.checkpoint: how often a run saves a checkpoint and how many it keeps (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from scse_dist.typed_yaml import ConfigError


@dataclass
class CheckpointConfig:
    # Steps between checkpoints (and one at the last step, and on preemption).
    every: int = 100
    # Checkpoints kept, locally and at a remote output_dir; older tags are pruned.
    keep: int = 2

    def check(self) -> None:
        for name, value in (("every", self.every), ("keep", self.keep)):
            if value <= 0:
                raise ConfigError(f"train.checkpoint.{name}: must be > 0, got {value}")
