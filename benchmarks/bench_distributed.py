"""Distributed costs of the looped model, measured side by side in one run on 2 ranks:

1. ZeRO-3 all-gathers per training step with T sampled per step, without and with LoopCore
   registered as a ZeRO-3 leaf (counted by wrapping torch.distributed's all-gather functions,
   which DeepSpeed's comm backend calls), as calls and as gathered elements / model size;
2. peak memory per rank (CUDA: max_memory_allocated; CPU: peak RSS above the pre-step level,
   sampled every ms with malloc returning freed blocks) at several T, with and without loop
   activation checkpointing, under ZeRO-3 with the leaf;
3. step time with loop checkpointing over step time without, at the same T (the goal is <= 1.4x).

    python benchmarks/bench_distributed.py                 # 2 ranks on this machine (gloo/nccl)
    python benchmarks/bench_distributed.py --depths 4,8,32 --d-model 256 --seq-len 256 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--depths", default="4,8,32", help="T values for memory and time")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (after 1 warm-up)")
    p.add_argument("--gather-steps", type=int, default=6, help="steps counted for all-gathers")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # output file: run as one rank
    return p.parse_args(argv)


# --------------------------------------------------------------------------- all-gather counting


class GatherCounter:
    """Wraps torch.distributed's all-gathers; install before DeepSpeed builds its comm backend,
    which captures the function objects."""

    def __init__(self) -> None:
        self.calls = 0
        self.elements = 0
        import torch.distributed as dist

        into, listed = dist.all_gather_into_tensor, dist.all_gather

        def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
            self.calls += 1
            self.elements += output_tensor.numel()
            return into(output_tensor, input_tensor, *args, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            self.calls += 1
            self.elements += sum(t.numel() for t in tensor_list)
            return listed(tensor_list, tensor, *args, **kwargs)

        dist.all_gather_into_tensor = all_gather_into_tensor
        dist.all_gather = all_gather

    def reset(self) -> None:
        self.calls = self.elements = 0


# --------------------------------------------------------------------------- peak memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator stats, or RSS sampled every ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = _rss_bytes()
            self._top = self._base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._top = max(self._top, _rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._top, _rss_bytes()) - self._base


# --------------------------------------------------------------------------- one rank


def run_config(args: argparse.Namespace, ckpt: str, depth_kind: str, depth: int):
    from scse_dist.config import load_config

    overrides = [
        "model.vocab_size=4096", f"model.d_model={args.d_model}", f"model.n_heads={args.n_heads}",
        f"model.max_seq_len={args.seq_len}", f"data.seq_len={args.seq_len}",
        "model.n_prelude=1", "model.n_core=1", "model.n_coda=1", f"model.depth={depth}",
        f"model.activation_checkpointing={ckpt}", f"train.batch.micro_batch_size={args.batch}",
        "train.engine.zero_stage=3",
        f"train.engine.deepspeed_config={REPO / 'configs/deepspeed/zero3.json'}",
        "train.schedule.warmup_steps=1", f"train.depth.kind={depth_kind}", "train.depth.min=2",
        "wandb.enabled=false"]
    return load_config(None, overrides)


def make_engine(cfg, loop_leaf: bool):
    from scse_dist.model import LoopedLM
    from scse_dist.train.engine import build_engine

    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    engine, _ = build_engine(cfg.train, cfg.run_dir, model, loop_leaf=loop_leaf)
    return engine, model


def train_step(engine, cfg, step: int, depth: int) -> None:
    g = torch.Generator().manual_seed(step)
    batch = torch.randint(0, cfg.model.vocab_size,
                          (cfg.train.batch.micro_batch_size, cfg.data.seq_len + 1),
                          generator=g).to(engine.device)
    out = engine(batch[:, :-1], batch[:, 1:], depth=depth, keep_logits=False)
    engine.backward(out.loss)
    engine.step()


def worker(args: argparse.Namespace) -> None:
    counter = GatherCounter()
    from scse_dist.distributed import init_distributed, shutdown
    from scse_dist.train.depth import sample_depth

    env = init_distributed()
    results = {"gathers": {}, "memory": {}, "time": {}}

    # 1. all-gathers per step under ZeRO-3, T sampled per step (uniform 2..8).
    cfg = run_config(args, "none", "uniform", 4)
    for leaf in (False, True):
        engine, model = make_engine(cfg, loop_leaf=leaf)
        numel = sum(p.ds_numel for p in model.parameters())
        depths = [sample_depth(s, cfg.train.depth, cfg.model.depth, 0)
                  for s in range(args.gather_steps + 1)]
        train_step(engine, cfg, 0, depths[0])  # warm-up: DeepSpeed records its trace
        counter.reset()
        for s in range(1, args.gather_steps + 1):
            train_step(engine, cfg, s, depths[s])
        results["gathers"]["leaf" if leaf else "no_leaf"] = {
            "calls_per_step": counter.calls / args.gather_steps,
            "model_sizes_per_step": counter.elements / args.gather_steps / numel,
            "depths": depths[1:]}
        engine.destroy()

    # 2 + 3. memory and step time at fixed T, with and without loop checkpointing, side by side.
    for depth in (int(d) for d in args.depths.split(",")):
        engines = {c: make_engine(run_config(args, c, "fixed", depth), True)[0]
                   for c in ("none", "loop")}
        cfg = run_config(args, "none", "fixed", depth)
        for engine in engines.values():
            train_step(engine, cfg, 0, depth)  # warm-up
        times = {"none": [], "loop": []}
        peaks = {"none": 0, "loop": 0}
        for s in range(1, args.steps + 1):
            for c, engine in engines.items():  # alternate, so drifting load hits both alike
                with PeakMemory(engine.device) as mem:
                    start = time.perf_counter()
                    train_step(engine, cfg, s, depth)
                    if engine.device.type == "cuda":
                        torch.cuda.synchronize()
                    times[c].append(time.perf_counter() - start)
                peaks[c] = max(peaks[c], mem.peak)
        results["memory"][depth] = {c: peaks[c] / 2**20 for c in peaks}
        results["time"][depth] = {c: statistics.median(times[c]) for c in times}
        for engine in engines.values():
            engine.destroy()

    gathered = [None] * env.world_size
    torch.distributed.all_gather_object(gathered, results)
    if env.rank == 0:
        Path(args.worker).write_text(json.dumps(gathered))
    shutdown()


# --------------------------------------------------------------------------- launcher + report


def launch(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    from scse_dist.distributed import free_port

    out = Path(tempfile.mkdtemp()) / "bench.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.world), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "") or
               ("cuda" if torch.cuda.is_available() else "cpu"),
               # glibc returns freed blocks to the OS at once, so RSS follows the allocator.
               MALLOC_MMAP_THRESHOLD_="65536",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=REPO)
             for r in range(args.world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench worker exit codes {codes}")
    return json.loads(out.read_text())


def report(ranks: list[dict]) -> None:
    r0 = ranks[0]
    print("\nZeRO-3 all-gathers per training step, T sampled uniformly in 2..8 "
          f"(depths {r0['gathers']['leaf']['depths']}):")
    print("| LoopCore | all-gather calls/step | gathered / model size per step |")
    print("|---|---|---|")
    for key, label in (("no_leaf", "plain (gathered per call)"), ("leaf", "ZeRO-3 leaf")):
        g = r0["gathers"][key]
        print(f"| {label} | {g['calls_per_step']:.1f} | {g['model_sizes_per_step']:.2f}x |")
    before, after = r0["gathers"]["no_leaf"], r0["gathers"]["leaf"]
    print(f"leaf / plain: calls {after['calls_per_step'] / before['calls_per_step']:.3f}x, "
          f"volume {after['model_sizes_per_step'] / before['model_sizes_per_step']:.3f}x")

    print("\nPeak memory per rank above the pre-step level (MiB, max over ranks) and median step "
          "time, ZeRO-3 + leaf:")
    print("| T | no checkpointing | loop checkpointing | memory ratio "
          "| step time ratio (loop/none) |")
    print("|---|---|---|---|---|")
    for depth in r0["memory"]:
        mem = {c: max(r["memory"][depth][c] for r in ranks) for c in ("none", "loop")}
        t = r0["time"][depth]
        print(f"| {depth} | {mem['none']:.0f} MiB ({t['none']:.2f} s) | {mem['loop']:.0f} MiB "
              f"({t['loop']:.2f} s) | {mem['loop'] / max(mem['none'], 1e-9):.2f}x | "
              f"{t['loop'] / t['none']:.2f}x |")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    report(launch(args, argv))


if __name__ == "__main__":
    main()
