"""train.optimizer: the optimizer's section of a run config (scse_dist.train.engine builds the
optimizer from it, scse_dist.train.muon its Muon half). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from scse_dist.typed_yaml import ConfigError


@dataclass
class OptimizerConfig:
    kind: Literal["torch_adamw", "deepspeed_fused_adam", "muon"] = "torch_adamw"
    lr: float = field(default=1e-3, metadata={"gt": 0})
    # {group of scse_dist.param_groups: factor} for AdamW's lr; unnamed groups keep 1
    lr_mult: dict[str, float] = field(default_factory=dict)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # Muon's own settings (kind: muon): Keller Jordan's reference defaults
    muon_lr: float = field(default=0.02, metadata={"gt": 0})
    muon_momentum: float = field(default=0.95, metadata={"ge": 0, "lt": 1})
    muon_weight_decay: float = field(default=0.0, metadata={"ge": 0})
    muon_scope: Literal["all", "loop"] = "all"
    # StableAdamW's per-tensor clipping (scse_dist.train.update_clip); 0: off
    update_clip: float = field(default=0.0, metadata={"ge": 0, "finite": True, "note": "0: off"})

    def check(self) -> None:
        """Combinations no optimizer can run with (one ConfigError naming the field)."""
        from scse_dist.param_groups import check_lr_mult  # torch-free, like this module

        check_lr_mult(self.lr_mult)
        if self.muon_scope != "all" and self.kind != "muon":
            raise ConfigError(f"train.optimizer.muon_scope: {self.muon_scope} narrows "
                              f"train.optimizer.kind: muon, but the optimizer is {self.kind}; set "
                              "it to muon or leave muon_scope at all")
        if self.update_clip and self.kind == "deepspeed_fused_adam":
            raise ConfigError("train.optimizer.update_clip: DeepSpeed's FusedAdam has no "
                              "per-tensor update clipping; use train.optimizer.kind: torch_adamw "
                              "(or muon)")

    def regrouping(self, saved_lr_mult: dict[str, float]) -> Optional[str]:
        """Why a resume from a checkpoint trained with `saved_lr_mult` cannot load its optimizer
        state (DeepSpeed loads it group by group): this lr_mult splits the param groups
        differently. None when the split is the same (changed factors of the same groups)."""
        from scse_dist.param_groups import lr_mult_split

        if lr_mult_split(saved_lr_mult) == lr_mult_split(self.lr_mult):
            return None
        return (f"train.optimizer.lr_mult: {saved_lr_mult!r} -> {self.lr_mult!r} (regroups the "
                "optimizer's parameters; a resume may change the factors, not which groups share "
                "one)")
