"""Peak memory of the LM loss, full logits vs chunked: python benchmarks/bench_loss.py [--quick]

The loss part of a training step: hidden states (micro-batch 8, seq 1024, d 768, fp32) through
the (V = 32000, d) head to the mean cross-entropy, then backward to the hidden states and the head
weight. Two variants, side by side in one run:
  full     F.cross_entropy(F.linear(h, W).float(), y)   (LoopedLM with keep_logits=True)
  chunked  scse_dist.model.loss.chunked_cross_entropy   (keep_logits=False: the trainer's path)
The goal is chunked / full <= 0.5.

Method (CPU): each variant runs in a fresh subprocess started with MALLOC_MMAP_THRESHOLD_=65536,
so glibc serves every large block with mmap and unmaps it on free: the resident set then follows
torch's live CPU tensors (tracemalloc would not see them; torch's allocator on CPU is plain
malloc). The child makes the inputs, runs the variant once (warm-up), drops the gradients,
resets the kernel's peak-RSS counter (write 5 to /proc/self/clear_refs), runs it again and
reports VmHWM - VmRSS-before: the most memory the loss's forward and backward held at once above
the inputs, the gradients of h and W included (the same 123 MiB for both). On CUDA (--device
cuda) the same difference is read from torch.cuda.max_memory_allocated after a reset.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from proc_memory import run_child, status_kib  # benchmarks/, beside this script
from scse_dist.model.loss import chunked_cross_entropy


def loss_step(variant: str, hidden: torch.Tensor, weight: torch.Tensor,
              targets: torch.Tensor) -> None:
    hidden.grad = weight.grad = None
    if variant == "full":
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    else:
        loss = chunked_cross_entropy(hidden, weight, targets)
    loss.backward()


def child(setting: dict) -> None:
    """Runs in the fresh subprocess: prints {"peak_mib", "step_s"} as JSON."""
    torch.set_num_threads(setting["threads"])
    device = torch.device(setting["device"])
    gen = torch.Generator().manual_seed(0)
    b, s, d, v = setting["batch"], setting["seq"], setting["d"], setting["vocab"]
    hidden = torch.randn(b, s, d, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, v, (b, s), generator=gen).to(device)
    loss_step(setting["variant"], hidden, weight, targets)  # warm-up
    hidden.grad = weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status_kib("VmRSS") * 1024
    start = time.perf_counter()
    loss_step(setting["variant"], hidden, weight, targets)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = status_kib("VmHWM") * 1024
    print(json.dumps({"peak_mib": (peak - before) / 2**20, "step_s": time.perf_counter() - start}))


def measure(variant: str, args: argparse.Namespace) -> dict:
    b, s = (2, 512) if args.quick else (8, 1024)
    setting = {"variant": variant, "batch": b, "seq": s, "d": 768, "vocab": 32000,
               "threads": args.threads, "device": args.device}
    return run_child(__file__, "--child", json.dumps(setting))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 2 x seq 512 for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    full, chunked = measure("full", args), measure("chunked", args)
    shape = "2 x 512" if args.quick else "8 x 1024"
    print(f"torch {torch.__version__}, {args.device}, tokens {shape}, d 768, vocab 32000")
    print(f"    {'variant':<10}{'peak MiB':>10}{'step s':>9}")
    for name, r in (("full", full), ("chunked", chunked)):
        print(f"    {name:<10}{r['peak_mib']:>10.1f}{r['step_s']:>9.2f}")
    print(f"    chunked / full peak memory: {chunked['peak_mib'] / full['peak_mib']:.3f} "
          f"(goal <= 0.5); step time ratio {chunked['step_s'] / full['step_s']:.2f}")


if __name__ == "__main__":
    main()
