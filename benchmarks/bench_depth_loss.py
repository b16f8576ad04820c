"""Step-time cost of train.loss.depth two_depths: python benchmarks/bench_depth_loss.py [--quick]

One training forward + backward (keep_logits=False, the trainer's chunked loss) of the scse model
at T = 4, off (the loss at T) against two_depths with short 2 (the same loop run, read out at
T = 2 as well: coda, final norm, head and cross-entropy once more, and their backward), timed
interleaved (off, on, off, on, ...) after a warm-up; the ratio is the median over the pairs (each
pair sees about the same machine load), times are the minima. The extra cost is the coda and the
head, not the loop, so it grows with the vocabulary and shrinks with T.

Model: d 256, 4 heads, seq 256, batch 8, vocab 4096, 1 prelude + 1 core + 1 coda block, fp32,
one thread (--quick halves d, seq and batch for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

DEPTH, SHORT, WEIGHT = 4, 2, 0.5


def step(model: LoopedLM, data: torch.Tensor, two_depths: bool) -> float:
    model.zero_grad(set_to_none=False)
    started = time.perf_counter()
    tokens, targets = data[:, :-1], data[:, 1:]
    if two_depths:
        out = model(tokens, targets, depth=DEPTH, readout_depths=[SHORT], keep_logits=False)
        assert out.loss is not None and out.loss_by_depth is not None
        (out.loss + WEIGHT * out.loss_by_depth[SHORT]).backward()
    else:
        out = model(tokens, targets, depth=DEPTH, keep_logits=False)
        assert out.loss is not None
        out.loss.backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="halve d, seq and batch")
    parser.add_argument("--pairs", type=int, default=8, help="interleaved (off, on) pairs")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d, (b, s) = (128, (4, 128)) if args.quick else (256, (8, 256))
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=4096, d_model=d, n_heads=4, max_seq_len=256,
                                 depth=DEPTH))
    data = torch.randint(0, 4096, (b, s + 1), generator=torch.Generator().manual_seed(0))
    for two_depths in (False, True):  # warm-up: allocator pools, gradients
        step(model, data, two_depths)
    off, on = [], []
    for _ in range(args.pairs):
        off.append(step(model, data, False))
        on.append(step(model, data, True))
    ratio = statistics.median(b / a for a, b in zip(off, on))
    print(f"depth_loss off: {min(off) * 1000:.0f} ms | two_depths (T {DEPTH}, short {SHORT}): "
          f"{min(on) * 1000:.0f} ms | ratio on/off {ratio:.3f} (median of {args.pairs} pairs; "
          f"d {d}, seq {s}, batch {b}, {args.threads} thread)")


if __name__ == "__main__":
    main()
