"""Test helper, one process: the CUDA optimizer path on CPU. torch's fused AdamW (what
build_optimizer picks on CUDA) against the unfused one, each inside a real DeepSpeed engine (world
size 1, gloo) over the same model, data and config, as JSON.

    python tests/fused_adamw_probe.py key=value ...   (config overrides)

Prints {"fused": [...], "max_abs": float, "max_param": float, "clipped": bool}: whether each
engine's client optimizer ran fused, the largest difference between the two runs' weights after
the steps, the largest weight, and whether train.optimizer.update_clip shrank some step.
"""

from __future__ import annotations

import json
import sys

import torch

from scse_dist.config import load_config
from scse_dist.distributed import init_distributed, shutdown
from scse_dist.model import LoopedLM
from scse_dist.train import engine as engine_module
from scse_dist.train.step import train_step

STEPS = 4


def run(overrides: list[str], fused: bool) -> tuple[torch.Tensor, bool, bool]:
    """(the flat weights after STEPS steps, whether AdamW ran fused, whether a step was clipped)"""
    cfg = load_config(None, overrides)
    built = []
    plain = engine_module.build_optimizer

    def build_optimizer(opt, model):  # as on CUDA when fused: torch.optim.AdamW(fused=True)
        built.append(plain(opt, model, on_cuda=fused))
        return built[-1]

    engine_module.build_optimizer = build_optimizer
    try:
        torch.manual_seed(0)
        engine, _ = engine_module.build_engine(cfg.train, cfg.run_dir, LoopedLM(cfg.model))
    finally:
        engine_module.build_optimizer = plain
    t, gen = cfg.train, torch.Generator().manual_seed(1)
    clipped = False
    for _ in range(STEPS):
        shape = (t.batch.micro_batch_size, cfg.data.seq_len + 1)
        windows = [torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
                   for _ in range(t.batch.grad_accum_steps)]
        assert not train_step(engine, windows, depth=cfg.model.depth).skipped
        clipped |= any(bool((f > 1).any()) for f in getattr(built[0], "last_factors", []))
    weights = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    return weights, bool(built[0].defaults["fused"]), clipped


def main(overrides: list[str]) -> None:
    init_distributed()
    unfused, fused_flag_0, clipped = run(overrides, fused=False)
    fused, fused_flag_1, _ = run(overrides, fused=True)
    print(json.dumps({"fused": [fused_flag_0, fused_flag_1],
                      "max_abs": float((fused - unfused).abs().max()),
                      "max_param": float(unfused.abs().max()), "clipped": clipped}))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
