"""train.start: how a run starts (resume, branch, warm start); torch-free, the fields:
docs/config.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError


@dataclass
class StartConfig:
    # auto resumes the newest intact checkpoint; never moves them aside (old-<time>/) and starts
    # fresh; require fails when there is nothing to resume.
    resume: Literal["auto", "never", "require"] = "auto"
    # Resume from this tag (step-N) instead of the newest; the newer tags are moved aside.
    resume_from: Optional[str] = None
    # A new run starts from another run's checkpoint (a run dir or one of its tags) with all a
    # resume restores and its own schedule; a run with a checkpoint of its own ignores it.
    branch_from: Optional[str] = None
    # Warm start: an export dir or URL whose weights alone a new run starts from (strict: every
    # key and shape must match); a run with a checkpoint ignores it.
    init_from: Optional[str] = None
    init_from_strict: bool = True

    def check(self) -> None:
        """Values and combinations no run can start from (one ConfigError naming the field)."""
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
