"""Test helper, one process per rank: load checkpoint TAG of a run at this world size (through
its universal form when the world size differs) and save every parameter's full fp32 weight,
exp_avg and exp_avg_sq (only the weight for a Muon matrix), gathered over the ranks, to OUT.

    python tests/resume_probe.py CONFIG OUT TAG
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from scse_dist.checkpoint.reshard import convert_once, load_universal
from scse_dist.checkpoint.tags import META_NAME, checkpoint_dir
from scse_dist.config import load_config
from scse_dist.distributed import init_distributed, is_rank0, shutdown
from scse_dist.model import LoopedLM
from scse_dist.train.engine import build_engine
from scse_dist.train.loop import with_world_batch


def main(config: str, out: str, tag: str) -> None:
    env = init_distributed()
    cfg = with_world_batch(load_config(config), env.world_size)
    engine, _ = build_engine(cfg.train, cfg.run_dir, LoopedLM(cfg.model))
    root = checkpoint_dir(Path(cfg.output_dir) / cfg.name)
    saved_world = json.loads((root / tag / META_NAME).read_text())["world_size"]
    if saved_world == env.world_size:
        path, _ = engine.load_checkpoint(str(root), tag=tag)
    else:
        path, _ = load_universal(engine, root, convert_once(root, tag))
    assert path is not None
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link the
        engine.optimizer._lazy_init_hp_params_optimizer_state()  # moments at the first step only
    state = {}
    for name, param in engine.module.named_parameters():
        state[f"{name}.fp32"] = safe_get_full_fp32_param(param).cpu()
        # train.optimizer.kind: muon: a Muon matrix has no Adam moments (its momentum is not per
        # slice)
        muon = getattr(param, "use_muon", False)
        for key in () if muon else ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{key}"] = safe_get_full_optimizer_state(param, key).cpu()
    if is_rank0():
        torch.save(state, out)
    shutdown(engine)


if __name__ == "__main__":
    main(*sys.argv[1:4])
