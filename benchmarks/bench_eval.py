"""Depth-sweep evaluation cost, measured side by side in one run:

    python benchmarks/bench_eval.py [--depths 48] [--d-model 128] [--seq-len 128] [--batch 8]

times, per batch, (a) one forward that reads out every depth 1..D (what scse-eval does),
(b) one forward at depth D alone, (c) D separate forwards at depths 1..D, and prints the
ratios sweep / deepest (goal: the deepest depth plus D read-outs) and separate / sweep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scse_dist.config import config_from_dict
from scse_dist.model import LoopedLM


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", type=int, default=48, help="sweep depths 1..D")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    cfg = config_from_dict({"model": {"vocab_size": args.vocab, "d_model": args.d_model,
                                      "n_heads": 4, "max_seq_len": args.seq_len, "depth": 4},
                            "data": {"seq_len": args.seq_len}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    x = torch.randint(3, args.vocab, (args.batch, args.seq_len))
    y = torch.randint(3, args.vocab, (args.batch, args.seq_len))
    depths = list(range(1, args.depths + 1))
    with torch.inference_mode():
        sweep = timed(lambda: model(x, y, depth=args.depths, readout_depths=depths,
                                    keep_logits=False), args.repeats)
        deepest = timed(lambda: model(x, y, depth=args.depths, keep_logits=False), args.repeats)
        separate = timed(lambda: [model(x, y, depth=d, keep_logits=False) for d in depths],
                         max(1, args.repeats // 2))
        readout = timed(lambda: model.readout(model.source(x)), args.repeats)
    print(f"model d={args.d_model} vocab={args.vocab}, batch {args.batch}x{args.seq_len}, "
          f"depths 1..{args.depths}, "
          f"{torch.get_num_threads()} threads")
    print(f"one-pass sweep   {sweep * 1e3:9.1f} ms")
    print(f"deepest only     {deepest * 1e3:9.1f} ms")
    print(f"separate depths  {separate * 1e3:9.1f} ms")
    print(f"one read-out     {readout * 1e3:9.1f} ms (prelude + coda + head)")
    print(f"sweep / deepest = {sweep / deepest:.2f}  (deepest + {args.depths - 1} read-outs "
          f"predicts {(deepest + (args.depths - 1) * readout) / deepest:.2f})")
    print(f"separate / sweep = {separate / sweep:.2f}")


if __name__ == "__main__":
    main()
