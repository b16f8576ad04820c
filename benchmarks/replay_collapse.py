"""Replay the steps after a checkpoint several ways, to see which part of the model's update makes
an SCSE loop collapse (issue 26): the loop diagnostics after each replayed step, per way.

    python benchmarks/replay_collapse.py --run runs/NAME --from-step 20 --steps 15

From checkpoint step S of a run (weights, optimizer state, data position and RNG, loaded as a
resume loads them: scse_dist.checkpoint.tags.resume_if_present, at world size 1 here), each way
runs steps S+1..S+K with the run's own config (the one saved in the tag), schedule and depth draws:

    moving       everything moves: the run itself (`logged` shows the run's diag rows to compare)
    anchor       SCSE's anchor map Q frozen
    core         the core frozen (its blocks, their norm gains, a concat adapter)
    norms        every norm gain frozen
    half_lr      every group at half the rate (the schedule's shape kept)
    all_frozen   every parameter frozen: the control, D_kept stays what it is at step S

Frozen means restored after each optimizer step (the module's weights and DeepSpeed's fp32 master
copy, safe_set_full_fp32_param); its optimizer moments still move. After each step the loop
diagnostics (scse_dist.train.diagnostics) run on the fixed held-out batch; the table prints
`--keys` (default D_kept) per step, one column per way. Run from the directory the run was
trained from (its data paths are relative to it). ZeRO stage 0-2; at another world size than the
run's the tag is converted once to DeepSpeed's universal form (beside it, as a resume does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
WAYS = ("moving", "anchor", "core", "norms", "half_lr", "all_frozen")


def frozen_names(way: str) -> Callable[[str], bool]:
    """Which parameters `way` holds still (by name)."""
    from scse_dist.param_groups import group_of

    return {
        "anchor": lambda n: group_of(n) == "anchor",
        "core": lambda n: n.startswith(("core.blocks.", "core.adapter.")),
        "norms": lambda n: group_of(n) == "norm",
        "all_frozen": lambda n: True,
    }.get(way, lambda n: False)


def replay(cfg: Any, run_dir: Path, tag: str, way: str, steps: int, window: Any
           ) -> list[dict[str, float]]:
    """Diagnostics rows after each of `steps` steps from `tag`, replayed `way`."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    from scse_dist.checkpoint.tags import resume_if_present
    from scse_dist.data.preflight import load_run_tokenizer
    from scse_dist.data.stream import TokenStream
    from scse_dist.model import LoopedLM
    from scse_dist.train.depth import sample_depth
    from scse_dist.train.depth_config import largest_trained_depth
    from scse_dist.train.diagnostics import loop_diagnostics
    from scse_dist.train.engine import build_engine
    from scse_dist.train.step import train_step

    t = cfg.train
    stream = TokenStream.from_config(cfg.data, "train", t.batch.micro_batch_size, 0, 1, t.seed,
                                     load_run_tokenizer(cfg.data, cfg.model).sha256)
    engine, _ = build_engine(cfg.train, cfg.run_dir, LoopedLM(cfg.model))
    start, _ = resume_if_present(engine, run_dir, stream, tag)
    if way == "half_lr":  # ConfigLR sets every group's lr from base_lrs at each step
        engine.lr_scheduler.base_lrs = [lr / 2 for lr in engine.lr_scheduler.base_lrs]
        engine.lr_scheduler.apply()
    model, batches = engine.module, iter(stream)
    hold = frozen_names(way)
    params = dict(model.named_parameters())
    # the fp32 master where DeepSpeed keeps one (bf16, ZeRO-1/2), else the weight itself
    held = {n: (safe_get_full_fp32_param(p) if hasattr(p, "_hp_mapping") else p).detach()
            .float().clone() for n, p in params.items() if hold(n)}
    max_depth = largest_trained_depth(t.depth, cfg.model.depth)
    rows = []
    for step in range(start, start + steps):
        depth = None if model.fixed_depth is not None else \
            sample_depth(step, t.depth, cfg.model.depth, t.seed, t.max_steps)
        result = train_step(engine, (next(batches) for _ in range(t.batch.grad_accum_steps)),
                            depth=depth, backprop_steps=t.depth.backprop_steps,
                            z_loss=t.loss.z_loss)
        with torch.no_grad():
            for name, weight in held.items():
                params[name].copy_(weight.to(params[name].dtype))
                if hasattr(params[name], "_hp_mapping"):  # ZeRO-1/2, bf16: the master too
                    safe_set_full_fp32_param(params[name], weight)
        model.eval()
        row = loop_diagnostics(model, window.to(engine.device), cfg.model.depth, max_depth)
        model.train()
        row["loss"] = float(result.loss_sum) / result.micro_batches
        rows.append({"step": step + 1, **{k.removeprefix("diag/"): v for k, v in row.items()}})
    engine.destroy()
    return rows


def logged_rows(run_dir: Path) -> dict[int, dict]:
    """The run's own loop diagnostics (its diag/ keys), by step; its `loss` is a mean over the
    log window, not one step's, so it is left out."""
    from scse_dist.run_dir import RunDir

    return {r["step"]: {k.removeprefix("diag/"): v for k, v in r.items() if k.startswith("diag/")}
            for r in RunDir(run_dir).metric_rows() if "diag/D_norm_t0" in r}


def table(results: dict[str, list[dict]], logged: dict[int, dict], key: str) -> str:
    ways = list(results)
    lines = [f"{key} after each replayed step (`logged`: the run's own diagnostics row)",
             " | ".join(["step", *ways, "logged"])]
    for i, row in enumerate(results[ways[0]]):
        step = row["step"]
        cells = [f"{results[w][i].get(key, float('nan')):.4g}" for w in ways]
        was = logged.get(step, {}).get(key)
        lines.append(" | ".join([str(step), *cells, "" if was is None else f"{was:.4g}"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="the run dir (runs/NAME)")
    parser.add_argument("--from-step", required=True, type=int,
                        help="a checkpoint step of that run, a few steps before the collapse")
    parser.add_argument("--steps", type=int, default=15, help="steps to replay (default 15)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--keys", default="D_kept",
                        help="diag keys to print, comma-separated (default D_kept), e.g. "
                             "D_kept,jacobian_norm,loop_gain,loss")
    parser.add_argument("--json", type=Path, help="also write every row of every way here")
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    bad = [w for w in ways if w not in WAYS]
    if bad or not ways:
        parser.error(f"--ways: unknown {', '.join(bad) or '(none given)'}; "
                     f"choose from {', '.join(WAYS)}")
    if args.steps < 1:
        parser.error(f"--steps: must be >= 1, got {args.steps}")

    from scse_dist.checkpoint.manifest import CONFIG_NAME
    from scse_dist.checkpoint.tags import checkpoint_dir, list_checkpoints, tag_for

    tag = tag_for(args.from_step)
    tag_dir = checkpoint_dir(args.run) / tag
    if not (tag_dir / CONFIG_NAME).is_file():
        have = ", ".join(p.name for p in list_checkpoints(args.run)) or "none"
        print(f"--from-step: {args.run} has no checkpoint {tag} (its tags: {have})",
              file=sys.stderr)
        return 2

    from scse_dist.config import load_saved_config
    from scse_dist.distributed import init_distributed, shutdown
    from scse_dist.train.callbacks.diagnostics import heldout_window
    from scse_dist.train.loop import with_world_batch

    saved = load_saved_config(tag_dir / CONFIG_NAME)
    if saved.train.engine.zero_stage == 3:
        print(f"replay_collapse: {args.run} trained at ZeRO-3, which the loop diagnostics skip; "
              "stages 0-2 only", file=sys.stderr)
        return 2
    cfg = with_world_batch(saved, 1)
    init_distributed()
    window = heldout_window(cfg.data, cfg.eval)
    if window is None:
        return 2
    results = {way: replay(cfg, args.run, tag, way, args.steps, window) for way in ways}
    shutdown()
    logged = logged_rows(args.run)
    for key in args.keys.split(","):
        print(table(results, logged, key), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
