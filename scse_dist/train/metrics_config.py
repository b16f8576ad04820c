"""The `wandb:` and `tensorboard:` sections: where the training metrics go besides metrics.jsonl
(scse_dist.train.metrics logs them, scse_dist.train.tensorboard writes the event files).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError


@dataclass
class WandbConfig:
    enabled: bool = True
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "scse-dist"
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class TensorBoardConfig:
    enabled: bool = False  # every metrics.jsonl row as TensorBoard scalars (rank 0)
    log_dir: Optional[str] = None

    def check(self) -> None:
        if self.log_dir is not None and ("://" in self.log_dir or not self.log_dir.strip()):
            raise ConfigError(f"tensorboard.log_dir: a local directory, or null for <run dir>/"
                              f"tensorboard; got {self.log_dir!r}")
