"""train.engine: how the DeepSpeed engine runs the step (scse_dist.train.engine). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError


@dataclass
class EngineConfig:
    # auto: bf16 where the accelerator supports it, fp32 otherwise (CPU).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    zero_stage: int = 1
    # DeepSpeed JSON merged over the generated config; it may only repeat engine._OWNED's keys
    deepspeed_config: Optional[str] = None
    # torch.compile each block's math (regional: one graph for every loop step and depth T).
    compile: bool = False

    def check(self) -> None:
        """Values no engine can run with (one ConfigError naming the field)."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.engine.zero_stage: must be 0, 1, 2 or 3, got "
                              f"{self.zero_stage}")
