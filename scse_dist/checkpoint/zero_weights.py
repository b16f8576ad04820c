"""A DeepSpeed model's full fp32 weights at any ZeRO stage, from a live engine or a saved tag."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch


def fp32_state_dict(engine: Any = None, root: Optional[str | Path] = None,
                    tag: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights (on CPU) of the live `engine` or of checkpoint `tag` under `root`: ZeRO
    1-3 with a tag, zero_to_fp32 from the partition files (one process); the live engine, a copy
    of its weights (ZeRO-3 gathers: every rank calls; bf16 widened); a ZeRO-0 tag, its model
    states."""
    if engine is not None:
        stage = engine.zero_optimization_stage()
    else:
        assert root is not None and tag is not None, "fp32_state_dict: an engine, or root and tag"
        stage = 1 if list((Path(root) / tag).glob("*optim_states.pt")) else 0
    from scse_dist.quiet import name_cpu_accelerator, quiet_output

    name_cpu_accelerator()
    if stage > 0 and root is not None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with quiet_output():  # its progress lines and bar; shown with -v, or if it fails
            return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    if engine is not None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None,
                                               enabled=stage == 3):
            # a copy: the module's tensors change with training, a gathered ZeRO-3 one is freed
            return {k: v.detach().float().cpu().clone()
                    for k, v in engine.module.state_dict().items()}
    # our own checkpoint: a trusted pickle
    assert root is not None and tag is not None  # no engine: checked above
    states = torch.load(Path(root) / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)
    return {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
