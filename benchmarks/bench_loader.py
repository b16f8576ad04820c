"""Loader benchmark, printed side by side: python benchmarks/bench_loader.py [--tokens N] [--quick]

(a) TokenStream tokens/s in one reader process (data.num_workers=0: the reading process is the
    one being timed; a DataLoader worker runs the same code) on pre-tokenized uint16 shards, next
    to the ceiling: the same packed tokens (eos included) read from one raw numpy memmap into the
    same (batch, seq_len + 1) LongTensor batches. Goals: ratio >= 0.5, >= 5M tokens/s per worker.
    Both the shuffled train order and the unshuffled (file) order are timed (local shards: an
    mmap slice per sample at its table's offsets in both); runs alternate and the best of
    `--repeats` counts (the files are in the page cache after the first pass, as hot shards are in
    training).
    With --workers 2 the aggregate rate through a real DataLoader is printed as well.
(b) Data time as a share of step time at the GPT-2-small config (configs/gpt2-small-scse.yaml):
    the GPU consumes tokens at 400 TFLOP/s x 40% MFU / flops_per_token (H100 bf16 estimate, at
    the nominal depth and its seq_len); if one worker fed the GPU synchronously, data time / step
    time = consumption rate / loader rate. Goal < 2%.
(c) Shard writing: tokens/s per core of `write_shards` (sentencepiece encoding + tar writing) on
    ../shared/data/webtext (skipped when that folder is absent).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from scse_dist.config import load_config
from scse_dist.data.shards import write_shards
from scse_dist.data.stream import TokenStream
from scse_dist.model import flops_per_token

REPO = Path(__file__).resolve().parents[1]
EOS = 2


class ArrayTokenizer:
    """write_shards' tokenizer interface over pre-made documents: the "text" is the doc index."""

    def __init__(self, docs: list[np.ndarray], vocab_size: int):
        self.docs, self.vocab_size, self.eos_id, self.sha256 = docs, vocab_size, EOS, "0" * 64

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.docs[int(t)] for t in texts]


def make_corpus(root: str, n_tokens: int, vocab: int) -> tuple[str, str, int]:
    rng = np.random.default_rng(0)
    lens = rng.integers(200, 2000, size=n_tokens // 1000 + 1)
    lens = lens[np.cumsum(lens) <= n_tokens]
    flat = rng.integers(3, vocab, size=int(lens.sum()), dtype=np.uint16)
    docs = np.split(flat, np.cumsum(lens)[:-1])
    shards = os.path.join(root, "shards")
    write_shards((str(i) for i in range(len(docs))), ArrayTokenizer(docs, vocab), shards,
                 shard_bytes=64 * 2**20)
    packed = np.insert(flat, np.cumsum(lens), EOS).astype(np.uint16)
    raw = os.path.join(root, "tokens.npy")
    np.save(raw, packed)
    return shards, raw, len(packed)


def memmap_batches(raw: str, seq_len: int, batch: int):
    import torch

    tokens = np.load(raw, mmap_mode="r")
    need = batch * (seq_len + 1)
    for i in range(len(tokens) // need):
        yield torch.from_numpy(tokens[i * need:(i + 1) * need].astype(np.int64)
                               .reshape(batch, seq_len + 1))


def rate(batches) -> float:
    start, n = time.perf_counter(), 0
    for b in batches:
        n += b.numel()
    return n / (time.perf_counter() - start)


def shard_writing_rate(root: str) -> float | None:
    src = REPO.parent / "shared" / "data" / "webtext" / "c4_en_train00000_first1000.jsonl"
    if not src.exists():
        return None
    from scse_dist.data.sources import iter_documents
    from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

    docs = list(iter_documents(str(src)))
    model = train_tokenizer(docs, 8000, os.path.join(root, "t.model"), max_sentences=20000)
    tok = Tokenizer.load(model)
    start = time.perf_counter()
    index = write_shards(docs, tok, os.path.join(root, "c4"), workers=0, encode_batch=64)
    # encode_batch threads are capped to one core so the rate is per core
    seconds = time.perf_counter() - start
    return sum(e["tokens"] for e in index["splits"]["train"]) / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2,
                   help="also time a DataLoader with this many workers")
    p.add_argument("--quick", action="store_true", help="2M tokens, one repeat")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.repeats = 2_000_000, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        shards, raw, n = make_corpus(root, args.tokens, 32000)
        make = lambda shuffle, workers=0: TokenStream(
            shards, seq_len=args.seq_len, batch_size=args.batch, loop=False, shuffle=shuffle,
            num_workers=workers)
        best = {"memmap": 0.0, "train (shuffled)": 0.0, "sequential": 0.0}
        for _ in range(args.repeats):
            best["memmap"] = max(best["memmap"],
                                 rate(memmap_batches(raw, args.seq_len, args.batch)))
            best["train (shuffled)"] = max(best["train (shuffled)"], rate(make(True)))
            best["sequential"] = max(best["sequential"], rate(make(False)))
        print(f"{n / 1e6:.1f}M tokens, seq_len {args.seq_len}, batch {args.batch}, one process")
        for name, value in best.items():
            print(f"  {name:18s} {value / 1e6:8.1f}M tokens/s   "
                  f"ratio to memmap {value / best['memmap']:.2f}")
        if args.workers > 1:
            total = rate(make(True, args.workers))
            print(f"  DataLoader, {args.workers} workers: {total / 1e6:.1f}M tokens/s in all "
                  f"({total / args.workers / 1e6:.1f}M per worker; {os.cpu_count()} cores, "
                  "shared with the main process)")

        cfg = load_config(str(REPO / "configs" / "gpt2-small-scse.yaml"))
        fpt = flops_per_token(cfg.model, cfg.model.depth, cfg.data.seq_len)
        gpu_rate = 400e12 * 0.40 / fpt
        worker = min(best["train (shuffled)"], best["sequential"])
        print(f"GPT-2-small SCSE: {fpt / 1e9:.2f} GFLOP/token -> one H100 at 40% MFU consumes "
              f"{gpu_rate / 1e3:.0f}K tokens/s; one synchronous worker at "
              f"{worker / 1e6:.1f}M tokens/s "
              f"-> data time {100 * gpu_rate / worker:.2f}% of step time (goal < 2%)")
        w = shard_writing_rate(root)
        if w is not None:
            print(f"shard writing (sentencepiece BPE 8000, C4 sample, one process): "
                  f"{w / 1e6:.2f}M tokens/s per core")


if __name__ == "__main__":
    main()
