"""The adaptive-depth frontier on held-out text: perplexity against mean loop steps per token for
exit rules at several thresholds (motion, kl), next to fixed depths, all on the same sequences.

Each rule runs teacher-forced and batched (LoopedLM.forward(exit_rule=...)): an exited token keeps
its state and the other tokens' later steps attend to its latest K/V. `--batch1` reruns every rule
one sequence at a time and prints how far the mean steps move (batched exit can overstate savings
when a batch runs until its slowest token; here decisions are per token, so they should not).

    python benchmarks/bench_exit.py                     # runs/quickstart/export, held-out shards
    python benchmarks/bench_exit.py --checkpoint EXPORT --data SHARDS --max-batches 10 --batch1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scse_dist.checkpoint.export import load_exported_model
from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.inputs import read_task_data
from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.model import parse_exit_rule


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="runs/quickstart/export", help="an export dir")
    p.add_argument("--data", default=None, help="held-out shard dir; default: config data.path")
    p.add_argument("--depths", default="1,2,4,8,16,32", help="fixed depths; the largest is the "
                                                             "reference and every rule's cap")
    p.add_argument("--motion", default="0.005,0.01,0.02,0.03,0.05,0.1", help="motion thresholds")
    p.add_argument("--kl", default="1e-4,1e-3,1e-2,3e-2", help="kl thresholds")
    p.add_argument("--min-steps", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-batches", type=int, default=10)
    p.add_argument("--batch1", action="store_true",
                   help="also run every rule one sequence at a time and compare the mean steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the frontier as JSON")
    return p.parse_args(argv)


def heldout_batches(cfg, data: str, batch_size: int, max_batches: int) -> list[torch.Tensor]:
    """The first max_batches held-out batches (B, S+1), read once so every setting sees them."""
    cfg.eval.batch_size = batch_size
    stream = read_task_data("heldout", cfg.data, cfg.model, batch_size, data).inputs
    batches = []
    for batch in stream:
        if len(batches) == max_batches:
            break
        batches.append(batch)
    return batches


def run_rule(model, batches, rule_text: str, cap: int) -> dict:
    stats = ExitStats(parse_exit_rule(f"{rule_text},min={ARGS.min_steps},max={cap}"))
    start = time.perf_counter()
    [row] = evaluate_heldout(model, batches, [cap], exit_stats=stats)
    row.update(stats.summary(), rule=rule_text, seconds=time.perf_counter() - start)
    return row


def main(argv=None) -> None:
    global ARGS
    ARGS = args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg = load_exported_model(args.checkpoint)
    batches = heldout_batches(cfg, args.data or cfg.data.path, args.batch_size, args.max_batches)
    depths = sorted(int(d) for d in args.depths.split(","))
    ref = depths[-1]
    tokens = sum(b[:, 1:].numel() for b in batches)
    print(f"{args.checkpoint} ({cfg.model.recurrence}, training depth {cfg.model.depth}): "
          f"{len(batches)} held-out batches, {tokens} tokens, reference depth {ref}")

    fixed = {r["depth"]: r for r in evaluate_heldout(model, batches, depths)}
    ppl_ref = fixed[ref]["ppl"]
    rules = [f"motion:{t}" for t in args.motion.split(",") if t] + \
            [f"kl:{t}" for t in args.kl.split(",") if t]
    adaptive = [run_rule(model, batches, rule, ref) for rule in rules]
    singles = []
    if args.batch1:
        one_by_one = [row[None] for b in batches for row in b]
        singles = [run_rule(model, one_by_one, rule, ref) for rule in rules]

    header = f"| {'setting':<14} | {'ppl':>9} | {'mean steps':>10} | {'p50':>3} | {'p90':>3} | " \
             f"{'ppl/ppl@' + str(ref):>11} | {'steps/' + str(ref):>8} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for d in depths:
        r = fixed[d]
        print(f"| {'fixed T=' + str(d):<14} | {r['ppl']:9.3f} | {d:10.2f} | {d:3d} | {d:3d} | "
              f"{r['ppl'] / ppl_ref:11.4f} | {d / ref:8.3f} |")
    for r in adaptive:
        print(f"| {r['rule']:<14} | {r['ppl']:9.3f} | {r['mean_steps']:10.2f} | "
              f"{r['steps_p50']:3d} | {r['steps_p90']:3d} | {r['ppl'] / ppl_ref:11.4f} | "
              f"{r['mean_steps'] / ref:8.3f} |")
    print(f"goal: ppl within 1% of ppl@{ref} with mean steps <= 25% of {ref}")
    for r in adaptive:
        ok = r["ppl"] / ppl_ref <= 1.01 and r["mean_steps"] / ref <= 0.25
        print(f"{r['rule']}: ppl / ppl@{ref} = {r['ppl'] / ppl_ref:.4f}, mean steps / {ref} = "
              f"{r['mean_steps'] / ref:.3f}  {'PASS' if ok else 'miss'}")
    for r, s in zip(adaptive, singles):
        print(f"{r['rule']}: batch size 1 mean steps {s['mean_steps']:.4f} vs batched "
              f"{r['mean_steps']:.4f} (diff {s['mean_steps'] - r['mean_steps']:+.4f}); ppl "
              f"{s['ppl']:.4f} vs {r['ppl']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"checkpoint": args.checkpoint, "tokens": tokens, "reference_depth": ref,
             "fixed": list(fixed.values()), "adaptive": adaptive, "batch1": singles}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
