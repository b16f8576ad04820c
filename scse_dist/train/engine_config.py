"""train.engine: how the DeepSpeed engine runs the step (scse_dist.train.engine). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class EngineConfig:
    # auto: bf16 where the accelerator supports it, fp32 otherwise (CPU).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    zero_stage: int = field(default=1, metadata={"ge": 0, "le": 3})
    # DeepSpeed JSON merged over the generated config; it may only repeat engine._OWNED's keys
    deepspeed_config: Optional[str] = None
    # torch.compile each block's math (regional: one graph for every loop step and depth T).
    compile: bool = False
