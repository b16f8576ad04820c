"""Model benchmarks on CPU, printed side by side: python benchmarks/bench_model.py [--quick]

(a) Step time (forward + backward) of scse over additive at T = 8. SCSE makes T + 1 core calls
    against T, so the goal is <= 1.125. Printed beside it: scse with the source anchor (no learned
    anchor map) and additive at T = 9 (the same number of core calls), each over additive at
    T = 8. Both models are timed interleaved (A, B, A, B, ...) after a warm-up; the ratio is the
    median over the interleaved pairs (each pair sees about the same machine load, so the median
    is robust to other processes), times are the minima.
(b) Peak memory of one training step at T = 32 over T = 4, with activation_checkpointing=loop
    (goal <= 1.5) and =none for contrast.
    Method: each setting runs in a fresh subprocess started with MALLOC_MMAP_THRESHOLD_=65536, so
    glibc serves large blocks with mmap and returns them on free: RSS then follows the live heap.
    The child builds the model, runs one warm-up step (so gradients and allocator pools exist),
    resets the kernel's peak-RSS counter (write 5 to /proc/self/clear_refs), runs one step and
    reports VmHWM - VmRSS-before (peak RSS above the pre-step level). Where clear_refs is not
    writable it falls back to ru_maxrss, which may then include the warm-up step.

Model: d = 256, 4 heads, seq 256, batch 8, vocab 4096, 1 prelude + 1 core + 1 coda block,
residual deeploop, fp32 (--quick halves d, seq and batch for a smoke run). One thread by default
(--threads): on a shared machine, busy-waiting OpenMP threads made 2-thread timings 4x slower and
noisy (measured), which swamps a 10% ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from proc_memory import run_child, status_kib  # benchmarks/, beside this script
from scse_dist.model import LoopedLM, flops_per_token
from scse_dist.model.config import ModelConfig


def model_config(quick: bool, **kw) -> ModelConfig:
    d = 128 if quick else 256
    return ModelConfig(vocab_size=4096, d_model=d, n_heads=4, max_seq_len=256, **kw)


def batch(cfg: ModelConfig, quick: bool) -> torch.Tensor:
    b, s = (4, 128) if quick else (8, 256)
    return torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))


def train_step(model: LoopedLM, data: torch.Tensor, depth: int) -> None:
    model.zero_grad(set_to_none=False)
    model(data[:, :-1], data[:, 1:], depth=depth, keep_logits=False).loss.backward()


# ------------------------------------------------------------------ (a) step time


# Timed side by side, each against additive at T=8: scse (the goal's subject); scse with the
# source anchor (no learned d x d anchor map: the 9/8 bound counts core calls only, the map adds
# about 1/12 of a block); additive at T=9 (the same number of core calls as scse at T=8).
VARIANTS = {
    "scse": ({"recurrence": "scse"}, 8),
    "scse anchor=source": ({"recurrence": "scse", "anchor": "source", "init_state": "zeros"}, 8),
    "additive T=9": ({"recurrence": "additive"}, 9),
    "additive": ({"recurrence": "additive"}, 8),
}


def step_time_ratio(quick: bool, reps: int = 7) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    models = {name: (LoopedLM(model_config(quick, **kw)), depth)
              for name, (kw, depth) in VARIANTS.items()}
    data = batch(models["scse"][0].cfg, quick)
    times: dict[str, list[float]] = {name: [] for name in models}
    for m, depth in models.values():
        train_step(m, data, depth)  # warm-up
    for _ in range(reps):
        for name, (m, depth) in models.items():
            start = time.perf_counter()
            train_step(m, data, depth)
            times[name].append(time.perf_counter() - start)
    seq = data.shape[1] - 1
    base_flops = flops_per_token(models["additive"][0].cfg, 8, seq)
    return {name: {"s": min(times[name]),
                   "ratio": statistics.median(a / b for a, b in zip(times[name],
                                                                    times["additive"])),
                   "flops_ratio": flops_per_token(m.cfg, depth, seq) / base_flops}
            for name, (m, depth) in models.items() if name != "additive"} | {
        "additive": {"s": min(times["additive"]), "ratio": 1.0, "flops_ratio": 1.0}}


# ------------------------------------------------------------------ (b) peak memory


def memory_child(setting: dict) -> None:
    """Runs in the fresh subprocess: print {"peak_mib": ..., "step_s": ...} as JSON."""
    torch.manual_seed(0)
    torch.set_num_threads(setting["threads"])
    quick = setting["quick"]
    cfg = model_config(quick, activation_checkpointing=setting["ckpt"])
    model = LoopedLM(cfg)
    data = batch(cfg, quick)
    train_step(model, data, setting["depth"])  # warm-up
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        exact = True
    except OSError:
        exact = False
    before = status_kib("VmRSS")
    start = time.perf_counter()
    train_step(model, data, setting["depth"])
    step_s = time.perf_counter() - start
    peak = status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": (peak - before) / 1024, "step_s": step_s, "exact": exact}))


def peak_memory(ckpt: str, depth: int, quick: bool, threads: int) -> dict:
    setting = json.dumps({"ckpt": ckpt, "depth": depth, "quick": quick, "threads": threads})
    return run_child(__file__, "--memory-child", setting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(json.loads(args.memory_child))
        return

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, quick={args.quick}")
    print("(a) step time (forward + backward), each over additive at T=8 (goal for scse: "
          "<= 1.125):")
    for name, r in step_time_ratio(args.quick).items():
        print(f"    {name:<20}{r['s']:>8.3f} s   ratio {r['ratio']:.3f}   "
              f"FLOPs ratio {r['flops_ratio']:.3f}")
    print("(b) peak RSS above the pre-step level, one training step:")
    print(f"    {'checkpointing':<14}{'T=4 MiB':>10}{'T=32 MiB':>10}{'ratio':>8}"
          f"{'T=4 s':>8}{'T=32 s':>8}")
    for ckpt in ("loop", "none"):
        lo, hi = (peak_memory(ckpt, t, args.quick, args.threads) for t in (4, 32))
        goal = "  (goal <= 1.5)" if ckpt == "loop" else ""
        print(f"    {ckpt:<14}{lo['peak_mib']:>10.1f}{hi['peak_mib']:>10.1f}"
              f"{hi['peak_mib'] / lo['peak_mib']:>8.2f}{lo['step_s']:>8.2f}"
              f"{hi['step_s']:>8.2f}{goal}")
        if not (lo["exact"] and hi["exact"]):
            print("    (clear_refs unavailable: ru_maxrss used, warm-up included)")


if __name__ == "__main__":
    main()
