"""train.checkpoint: how often a run saves a checkpoint and how many it keeps (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckpointConfig:
    # Steps between checkpoints (and one at the last step, and on preemption).
    every: int = field(default=100, metadata={"gt": 0})
    # Checkpoints kept, locally and at a remote output_dir; older tags are pruned.
    keep: int = field(default=2, metadata={"gt": 0})
