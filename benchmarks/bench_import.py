"""`scse-data import`'s read path beside a raw memmap read, printed side by side:

    python benchmarks/bench_import.py [--tokens 200_000_000] [--repeats 3] [--write-tokens N]

A synthetic llm.c `.bin` (GPT-2 layout: uint16 ids below 50257, documents of geometric length
with mean 1000, each preceded by `<|endoftext|>` 50256) in a temporary folder, deleted after.
Timed in one process, alternating, best of `--repeats` with the page cache warm:
(a) raw: `np.memmap(...).sum()` over the ids, one pass reading every token;
(b) import's read path: read_token_files (header, memory map, the vocabulary check and the eos
    split, chunked and vectorised), everything the import does before it writes.
With `--write-tokens N` > 0 it also times the whole import (the shard writer, no held-out
split) of the first N tokens' worth of the file. Goal: (b) >= 50M tokens/s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from scse_dist.data.pretokenized import import_tokens, read_token_files
from scse_dist.data.tokenizer import Tokenizer

EOS, VOCAB = 50256, 50257


class GPT2Ids(Tokenizer):
    """Only what the import reads of a tokenizer: GPT-2's vocabulary size and eos."""

    vocab_size, eos_id, bos_id, eos_token = VOCAB, EOS, EOS, "<|endoftext|>"

    def __init__(self) -> None:
        super().__init__(b"gpt-2 ids (benchmark)", "gpt2-ids")


def write_bin(path: Path, tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, EOS, tokens, dtype=np.uint16)
    starts = np.cumsum(rng.geometric(1 / 1000, tokens // 500 + 1))
    ids[np.concatenate([[0], starts[starts < tokens]])] = EOS
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, tokens
    with open(path, "wb") as f:
        f.write(header.tobytes())
        ids.tofile(f)


def raw_read(path: Path) -> int:
    return int(np.memmap(path, dtype=np.uint16, mode="r", offset=1024).sum(dtype=np.uint64))


def import_read(path: Path) -> int:
    return len(read_token_files([str(path)], "llm-c-bin", GPT2Ids())[0].eos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), default=200_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-tokens", type=lambda s: int(s.replace("_", "")), default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.bin"
        write_bin(path, args.tokens)
        raw_read(path)  # into the page cache
        best = {"raw memmap sum": float("inf"), "import read path": float("inf")}
        for _ in range(args.repeats):
            for name, fn in (("raw memmap sum", raw_read), ("import read path", import_read)):
                t = time.perf_counter()
                fn(path)
                best[name] = min(best[name], time.perf_counter() - t)
        docs = import_read(path)
        print(f"{args.tokens:,} tokens, {docs:,} documents, best of {args.repeats}:")
        for name, dt in best.items():
            print(f"  {name:17s} {dt:7.3f} s  {args.tokens / dt / 1e6:8.1f}M tokens/s")
        ratio = best["raw memmap sum"] / best["import read path"]
        print(f"  import read path / raw: {ratio:.2f} of raw's rate; goal >= 50M tokens/s: "
              f"{'PASS' if args.tokens / best['import read path'] >= 50e6 else 'MISS'}")
        if args.write_tokens:
            small = Path(tmp) / "small.bin"
            write_bin(small, args.write_tokens, seed=1)
            t = time.perf_counter()
            import_tokens(read_token_files([str(small)], "llm-c-bin", GPT2Ids()), GPT2Ids(),
                          str(Path(tmp) / "shards"))
            dt = time.perf_counter() - t
            print(f"  whole import (shards written) of {args.write_tokens:,} tokens: {dt:.2f} s, "
                  f"{args.write_tokens / dt / 1e6:.1f}M tokens/s")


if __name__ == "__main__":
    main()
