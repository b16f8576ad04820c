"""Time of `scse-eval --task lambada` per batch, and projected for the 5153-passage test set:

    python benchmarks/bench_lambada.py --checkpoint runs/quickstart/export \\
        --data ../shared/data/lambada/lambada_development_plain_text.txt --threads 1 [--busy]

scores an evenly spaced sample of `--passages` passages (every k-th, so their lengths are the
file's) at `--depths` with `--threads` intra-op threads, through run_task (what scse-eval runs),
and prints the wall and CPU seconds per batch of `--batch-size`, the load average
and the projection to `--full` passages. `--busy` starts one busy-looping process beside it (a
shared machine). Only run_task's interface is used, so the same script times older code too
(PYTHONPATH=an older checkout).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="runs/quickstart/export", help="an export dir")
    p.add_argument("--data", default="../shared/data/lambada/lambada_development_plain_text.txt")
    p.add_argument("--depths", default="1,8,48")
    p.add_argument("--passages", type=int, default=160, help="sample size (0: the whole file)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--busy", action="store_true", help="one busy-looping process beside it")
    p.add_argument("--full", type=int, default=5153, help="passages to project to (the test set)")
    return p.parse_args(argv)


def sample_lines(path: str, n: int) -> list[str]:
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not n or n >= len(lines):
        return lines
    step = len(lines) / n
    return [lines[int(i * step)] for i in range(n)]


def main(argv=None) -> None:
    args = parse_args(argv)
    from scse_dist.checkpoint.export import load_exported_model
    from scse_dist.eval.task_run import run_task

    torch.set_num_threads(args.threads)
    model, cfg = load_exported_model(args.checkpoint)
    cfg.eval.batch_size = args.batch_size
    lines = sample_lines(args.data, args.passages)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "lambada_sample.txt"
            data.write_text("\n".join(lines) + "\n", encoding="utf-8")
            load = os.getloadavg()[0]
            wall, cpu = time.perf_counter(), time.process_time()
            run_task("lambada", model, cfg, str(data), [int(d) for d in args.depths.split(",")],
                     str(Path(tmp) / "r.json"), "bench")
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    batches = -(-len(lines) // args.batch_size)
    per_batch = wall / batches
    print(f"{len(lines)} passages, {batches} batches of {args.batch_size}, depths {args.depths}, "
          f"{args.threads} thread(s){', beside a busy process' if args.busy else ''}, "
          f"1-min load {load:.1f} at start")
    print(f"per batch: {per_batch:.2f} s wall, {cpu / batches:.2f} s CPU; "
          f"projected for {args.full} passages: "
          f"{per_batch * args.full / args.batch_size / 60:.1f} min")


if __name__ == "__main__":
    main()
