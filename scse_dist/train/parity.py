"""ZeRO parity check: train a config on a fixed synthetic global batch at any world size and stage.

    python -m scse_dist.train.parity --config tiny.yaml --out DIR --stages 1,2,3 [key=value ...]
    torchrun --nproc_per_node 2 -m scse_dist.train.parity --config tiny.yaml --out DIR2

Step s's batch comes from (train.seed, s) alone, rank r's micro-batch m being its slice
m * world + r, so the optimizer sees the same global batch at every world size. Rank 0 writes
`DIR/stage{S}/losses.json` (each step's mean loss) and `model.safetensors` per stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from scse_dist.config import RunConfig, load_config
from scse_dist.data.config import DataConfig
from scse_dist.model.config import ModelConfig
from scse_dist.train.config import TrainConfig


def global_batch(model: ModelConfig, data: DataConfig, train: TrainConfig, step: int, size: int
                 ) -> torch.Tensor:
    """`size` rows of arithmetic progressions (start + stride * i) mod min(64, vocab): learnable,
    so the loss falls within a few steps and the curves compare something that moves."""
    g = torch.Generator().manual_seed(train.seed * 1_000_003 + step)
    vocab = min(64, model.vocab_size)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 8, (size, 1), generator=g)
    return (start + stride * torch.arange(data.seq_len + 1)) % vocab


def run_stage(cfg: RunConfig, stage: int, out_dir: Path) -> list[float]:
    import dataclasses

    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.checkpoint.zero_weights import fp32_state_dict
    from scse_dist.distributed import is_rank0
    from scse_dist.model import LoopedLM
    from scse_dist.train.depth import sample_depth, short_depth_loss
    from scse_dist.train.engine import build_engine
    from scse_dist.train.loop import seed_everything
    from scse_dist.train.step import train_step

    engine = dataclasses.replace(cfg.train.engine, zero_stage=stage, deepspeed_config=None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, engine=engine))
    t = cfg.train
    world = dist.get_world_size()
    rank = dist.get_rank()
    seed_everything(t.seed)
    model = LoopedLM(cfg.model)
    engine, _ = build_engine(t, cfg.run_dir, model)
    micro, accum = t.batch.micro_batch_size, t.batch.grad_accum_steps
    assert isinstance(micro, int), "parity: train.batch.micro_batch_size must be a number, not auto"
    losses = []
    for step in range(t.max_steps):
        depth = None if model.fixed_depth is not None else \
            sample_depth(step, t.depth, cfg.model.depth, t.seed, t.max_steps)
        batch = global_batch(cfg.model, cfg.data, t, step, micro * accum * world)
        parts = (batch[(m * world + rank) * micro:(m * world + rank + 1) * micro]
                 for m in range(accum))
        result = train_step(engine, parts, depth=depth, backprop_steps=t.depth.backprop_steps,
                            z_loss=t.loss.z_loss, **short_depth_loss(t))
        total = result.loss_sum.detach().cpu()
        dist.all_reduce(total)
        losses.append(float(total) / (world * accum))
    params = fp32_state_dict(engine)  # every rank: ZeRO-3 gathers its partitions
    if is_rank0():
        stage_dir = out_dir / f"stage{stage}"
        save_exported_model(params, cfg, str(stage_dir))
        (stage_dir / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    engine.destroy()
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scse_dist.train.parity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, help="directory for stage{S}/ results (rank 0)")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages to run one after another")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_intermixed_args(argv)

    from scse_dist.distributed import init_distributed, shutdown
    from scse_dist.train.loop import with_world_batch

    cfg = load_config(args.config, args.overrides)
    env = init_distributed()
    cfg = with_world_batch(cfg, env.world_size)
    for stage in (int(s) for s in args.stages.split(",")):
        losses = run_stage(cfg, stage, Path(args.out))
        if env.rank == 0:
            print(f"world {env.world_size} ZeRO-{stage}: losses {losses[0]:.6f} .. "
                  f"{losses[-1]:.6f}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
