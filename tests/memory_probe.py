"""Test helper, one process: a real DeepSpeed engine's memory over two training steps, as JSON.

    python tests/memory_probe.py key=value ...   (config overrides; world size 1, gloo, CPU)

Prints {"states": bytes, "peak": bytes}: the growth of the process's RSS over its RSS before the
model existed, after the first step (weights, optimizer state, what DeepSpeed keeps) and at the
peak of the second step (VmHWM reset through /proc/self/clear_refs just before it: states and the
activations of backward's peak). Run it under MALLOC_MMAP_THRESHOLD_=65536: every tensor larger
than 64 KiB is then its own mapping, so freed tensors leave the RSS and the peak is the live
bytes', not the allocator's high-water mark. First-call costs (DeepSpeed's imports, autograd's
threads, the inductor import of ZeRO-1/2's first reduction) are paid by a throwaway engine before
the baseline is read.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from scse_dist.config import load_config
from scse_dist.distributed import init_distributed, shutdown
from scse_dist.model import LoopedLM
from scse_dist.train.engine import build_engine
from scse_dist.train.micro_batch import _release_freed_memory, _status_kib
from scse_dist.train.step import train_step


def rss() -> int:
    return _status_kib("VmRSS") * 1024


def main(overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    init_distributed()
    torch.manual_seed(0)
    warm_cfg = load_config(None, overrides + ["model.d_model=16", "model.n_heads=1",
                                              "model.vocab_size=64", "data.seq_len=8",
                                              "train.batch.micro_batch_size=1",
                                              "train.batch.grad_accum_steps=1"])
    warm, _ = build_engine(warm_cfg.train, warm_cfg.run_dir, LoopedLM(warm_cfg.model))
    for _ in range(2):
        train_step(warm, [torch.zeros(1, 9, dtype=torch.long)], depth=2)
    del warm
    gc.collect()
    _release_freed_memory()
    base = rss()
    engine, _ = build_engine(cfg.train, cfg.run_dir, LoopedLM(cfg.model))
    t = cfg.train

    def step() -> None:
        windows = [torch.randint(0, cfg.model.vocab_size,
                                 (t.batch.micro_batch_size, cfg.data.seq_len + 1))
                   for _ in range(t.batch.grad_accum_steps)]
        train_step(engine, windows, depth=cfg.model.depth)

    step()
    _release_freed_memory()
    states = rss() - base
    Path("/proc/self/clear_refs").write_text("5")
    step()
    print(json.dumps({"states": states, "peak": _status_kib("VmHWM") * 1024 - base}))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
