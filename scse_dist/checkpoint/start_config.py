"""train.start: how a run starts when its run dir has no checkpoint of its own (resume, branch,
warm start), and how often a crashed job starts again; scse_dist.checkpoint.resume and
.warm_start act on it, scse_dist.launch.retries on max_retries.

Torch-free, like scse_dist.train.config, which composes it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

from scse_dist.model.config import ConfigError


@dataclass
class StartConfig:
    # A run dir with checkpoints: auto resumes the newest intact one (a changed model or data
    # stream is refused); never moves them aside (run_dir/old-<time>/) and starts fresh; require
    # fails when there is nothing to resume.
    resume: Literal["auto", "never", "require"] = "auto"
    # Resume from this checkpoint tag (step-N) instead of the newest; the run dir's newer tags
    # are moved aside (run_dir/old-<time>/checkpoints). For one command line: a requeue with it
    # still set goes back to step-N again.
    resume_from: Optional[str] = None
    # Branch: a new run starts from another run's checkpoint with everything a resume restores
    # (weights, optimizer state, step, data position, RNG) and its own schedule: a cooldown off
    # a stable phase. A local run dir (its newest intact checkpoint) or one of its tags
    # (runs/x/checkpoints/step-0001000); linked or copied into this run's checkpoints. A run
    # that has a checkpoint of its own resumes that and ignores this.
    branch_from: Optional[str] = None
    # Warm start: an export dir or URL whose weights (only) a new run starts from; a run that
    # has a checkpoint resumes it and ignores this. Strict: every key and shape must match.
    init_from: Optional[str] = None
    init_from_strict: bool = True
    # A training job that crashed (any exit but 0, bad config/input 2/65/66, 3 non-finite steps,
    # 4 spikes, 75 preempted, 130 Ctrl-C) is requeued this many times on a batch system that can
    # requeue (Slurm), and starts again by resuming the latest verified checkpoint; the same
    # failure at the same step twice stops it sooner (scse_dist.launch.retries). 0: never.
    max_retries: int = 2

    def check(self) -> None:
        """Values and combinations no run can start from (one ConfigError naming the field)."""
        if self.max_retries < 0:
            raise ConfigError(f"train.start.max_retries: must be >= 0, got {self.max_retries}")
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("train.start.init_from: an export dir or URL, or null; got an "
                              "empty string")
        if self.resume_from is not None:
            if not re.fullmatch(r"step-\d+", self.resume_from):
                raise ConfigError(f"train.start.resume_from: expected a checkpoint tag like "
                                  f"step-40, got {self.resume_from!r}")
            if self.resume == "never":
                raise ConfigError("train.start.resume_from: contradicts train.start.resume=never "
                                  "(which starts fresh); leave train.start.resume at auto")
        if self.branch_from is None:
            return
        if not self.branch_from.strip():
            raise ConfigError("train.start.branch_from: a run dir or checkpoint tag dir, or "
                              "null; got an empty string")
        if self.resume_from is not None:
            raise ConfigError("train.start.branch_from: contradicts train.start.resume_from (a "
                              "tag of this run); name the checkpoint to branch from in "
                              "branch_from alone")
        if self.init_from is not None:
            raise ConfigError("train.start.branch_from: contradicts train.start.init_from (an "
                              "export's weights alone, fresh optimizer and data); set one of them")
