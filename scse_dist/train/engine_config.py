"""train.engine: how the DeepSpeed engine runs the step (scse_dist.train.engine builds it from
this section: precision, ZeRO stage, the DeepSpeed JSON merged over the generated config, and
regional torch.compile).

Torch-free, like scse_dist.train.config, which composes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from scse_dist.model.config import ConfigError


@dataclass
class EngineConfig:
    # auto: bf16 where the accelerator supports it, fp32 otherwise (CPU).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    zero_stage: int = 1
    # Optional DeepSpeed JSON merged over the generated config (e.g. configs/deepspeed/zero3.json):
    # its values override generated keys, except keys a config field decides (engine._OWNED: batch
    # sizes, clipping, ZeRO stage, precision, lr/betas/weight decay, scheduler), which it may only
    # repeat with the same value (engine.build_ds_config).
    deepspeed_config: Optional[str] = None
    # torch.compile each block's math (regional: one graph for every loop step and depth T).
    compile: bool = False

    def check(self) -> None:
        """Values no engine can run with (one ConfigError naming the field); the checks against
        the optimizer are TrainConfig's."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.engine.zero_stage: must be 0, 1, 2 or 3, got "
                              f"{self.zero_stage}")
