"""`scse-data shards` over many processes or jobs (docs/data.md, "Corpus scale"): part K of N
(`--part K/N`, a contiguous run of units: sources.partition) writes its token ids per split under
`out/parts/part-K-of-N/` ({split}.tokens, the shards' dtype without eos; {split}.lens, uint32; and
part.json, the counts and all the shards depend on). `scse-data merge out` packs the parts in
order with the one-process writer: sample and shard boundaries depend on all before them, so
only the (cheap) packing runs once, and the bytes are those one process writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import fsspec
import numpy as np

from scse_dist.atomic import output_dir
from scse_dist.cli_errors import InputError
from scse_dist.data.index import SPLITS, join
from scse_dist.data.shards import (
    check_layout,
    finish_index,
    no_documents,
    shard_meta,
    shards_output,
    split_writers,
    tokenize_into,
)
from scse_dist.data.tokenizer import Tokenizer

PARTS_DIR = "parts"
PART_META = "part.json"
_FLUSH_BYTES = 16 << 20  # a part writes its arrays in pieces of about this size
_READ_DOCS = 1 << 18  # the merge reads a part's documents this many at a time


def part_dir(root: str, k: int, n: int) -> str:
    return join(join(root, PARTS_DIR), f"part-{k:05d}-of-{n:05d}")


class _PartWriter:
    """One split of one part: token ids and lengths appended to two raw files."""

    def __init__(self, fs: Any, root: str, split: str, dtype: str):
        self.fs, self.root, self.split, self.dtype = fs, root, split, np.dtype(dtype)
        self.files = {k: fs.open(join(root, f"{split}.{k}"), "wb") for k in ("tokens", "lens")}
        self.pending: list[Any] = []
        self.pending_tokens = self.documents = self.tokens = 0

    def add(self, ids: Any) -> None:
        self.pending.append(ids)
        self.pending_tokens += len(ids)
        if self.pending_tokens * self.dtype.itemsize >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        lens = np.array([len(d) for d in self.pending], dtype=np.uint32)
        self.files["tokens"].write(np.concatenate(
            [np.asarray(d, dtype=self.dtype) for d in self.pending]).tobytes())
        self.files["lens"].write(lens.tobytes())
        self.documents += len(lens)
        self.tokens += self.pending_tokens
        self.pending, self.pending_tokens = [], 0

    def finish(self) -> dict:
        self._flush()
        for f in self.files.values():
            f.close()
        return {"documents": self.documents, "tokens": self.tokens}


def write_part(documents: Iterable[str], tokenizer: Tokenizer, out: str, part: tuple[int, int],
               heldout_fraction: float = 0.0, shard_bytes: int = 256 * 2**20,
               sample_tokens: int = 65536, sources: list[str] | None = None,
               encode_batch: int = 256, progress_every: float = 0.0, workers: int = 0) -> dict:
    """Tokenize part `part` = (K, N) of the documents (already narrowed to it by the caller) into
    out/parts/part-K-of-N; return its part.json. A part may hold no document."""
    check_layout(heldout_fraction, sample_tokens, shard_bytes)
    k, n = part
    meta = shard_meta(tokenizer, sample_tokens, sources)
    # a part's folder is only ever written by a part, so a rerun replaces it
    with output_dir(part_dir(out, k, n), lambda _: True, PART_META) as tmp:
        fs, here = fsspec.core.url_to_fs(tmp)
        writers = {s: _PartWriter(fs, here, s, meta["dtype"]) for s in SPLITS}
        tokenize_into(documents, tokenizer, writers, heldout_fraction,
                      f"shards {out} part {k}/{n}", encode_batch, progress_every, workers)
        record = {**meta, "part": k, "parts": n, "shard_bytes": shard_bytes,
                  "heldout_fraction": heldout_fraction,
                  "splits": {s: w.finish() for s, w in writers.items()}}
        with fs.open(join(here, PART_META), "w") as f:
            json.dump(record, f, indent=1)
    return record


def _read_parts(fs: Any, root: str, out: str) -> list[dict]:
    base = join(root, PARTS_DIR)
    metas = []
    for path in sorted(fs.glob(join(base, "part-*-of-*/" + PART_META))):
        with fs.open(path, "r") as f:
            metas.append(json.load(f))
    if not metas:
        raise FileNotFoundError(f"{join(out, PARTS_DIR)}: no finished part to merge (run "
                                "`scse-data shards ... --part K/N` for K = 0..N-1 first)")
    n = metas[0]["parts"]
    if any(m["parts"] != n for m in metas):
        raise InputError(f"{join(out, PARTS_DIR)}: parts of different splits "
                         f"({sorted({m['parts'] for m in metas})} parts); remove the stale ones")
    missing = sorted(set(range(n)) - {m["part"] for m in metas})
    if missing:
        raise InputError(f"{join(out, PARTS_DIR)}: parts {missing} of {n} are missing or "
                         f"unfinished; run `scse-data shards ... --part K/{n}` for them")
    keys = ("tokenizer_sha256", "vocab_size", "dtype", "sample_tokens", "shard_bytes",
            "heldout_fraction", "sources")
    for m in metas:
        for key in keys:
            if m[key] != metas[0][key]:
                raise InputError(f"{join(out, PARTS_DIR)}: part {m['part']} has {key} "
                                 f"{m[key]!r}, part {metas[0]['part']} {metas[0][key]!r}; "
                                 "every part must run the same command")
    return sorted(metas, key=lambda m: m["part"])


def _part_documents(fs: Any, here: str, split: str, dtype: np.dtype, documents: int
                    ) -> Iterator[np.ndarray]:
    """A part's documents of one split, as array slices, in order."""
    with fs.open(join(here, f"{split}.lens"), "rb") as lf, \
            fs.open(join(here, f"{split}.tokens"), "rb") as tf:
        left = documents
        while left:
            lens = np.frombuffer(lf.read(min(left, _READ_DOCS) * 4), dtype=np.uint32)
            tokens = np.frombuffer(tf.read(int(lens.sum(dtype=np.int64)) * dtype.itemsize),
                                   dtype=dtype)
            if not len(lens) or len(tokens) != int(lens.sum(dtype=np.int64)):
                raise InputError(f"{here}: {split}.tokens or {split}.lens is shorter than "
                                 "part.json says; rerun this part")
            ends = np.cumsum(lens, dtype=np.int64)
            for a, b in zip(ends - lens, ends):
                yield tokens[a:b]
            left -= len(lens)


def merge_parts(out: str, into: str | None = None) -> dict:
    """Pack the parts under out/parts into the shards and index.json one process would write, in
    `out` (shards_output) or `into` (a new folder the caller publishes); remove out/parts."""
    fs, root = fsspec.core.url_to_fs(out)
    metas = _read_parts(fs, root, out)
    if sum(m["splits"][s]["documents"] for m in metas for s in SPLITS) == 0:
        raise no_documents(out)
    with shards_output(out) if into is None else contextlib.nullcontext(into) as tmp:
        fs, dest = fsspec.core.url_to_fs(tmp)
        first = metas[0]
        writers = split_writers(fs, dest, first["dtype"], first["eos_id"],
                                first["sample_tokens"], first["shard_bytes"])
        dtype = np.dtype(first["dtype"])
        for m in metas:
            here = part_dir(root, m["part"], m["parts"])
            for split in SPLITS:
                for doc in _part_documents(fs, here, split, dtype,
                                           m["splits"][split]["documents"]):
                    writers[split].add(doc)
        index = finish_index(fs, dest, writers, first)
    fs.rm(join(root, PARTS_DIR), recursive=True)  # once the shards are in place
    return index


class PartFailed(Exception):
    """A part run by run_and_merge exited `status` (its own error line is on stderr)."""

    def __init__(self, status: int, part: int):
        super().__init__(f"part {part} exited {status}")
        self.status, self.part = status, part


def run_and_merge(argv: Callable[[str], list[str]], out: str, n: int) -> dict:
    """`scse-data shards --processes n`: parts 0..n-1 as processes (`argv(folder)`: the shards
    command writing to `folder`), then the merge, in shards_output(out). Returns the index;
    PartFailed for the first part that fails (the others are stopped)."""
    with shards_output(out) as tmp:
        fs, root = fsspec.core.url_to_fs(tmp)
        fs.makedirs(join(root, PARTS_DIR))  # here, not by the parts, which share it
        status, which = run_parts([[sys.executable, "-m", "scse_dist.data.cli", *argv(tmp),
                                    "--part", f"{k}/{n}"] for k in range(n)])
        if status:
            raise PartFailed(status, which)
        return merge_parts(tmp, into=tmp)


def run_parts(argvs: Sequence[Sequence[str]]) -> tuple[int, int]:
    """Run the part commands at once, each in its own process group; SIGINT and SIGTERM go to all
    (then KeyboardInterrupt), and the first that fails stops the others. Returns (0, -1), or
    that part's exit status and number (its error line is on stderr)."""
    # their stdout (a line per part) is not shown: the caller merges and prints the total
    procs = [subprocess.Popen(list(a), start_new_session=True, stdout=subprocess.DEVNULL)
             for a in argvs]
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed, which = 0, -1
    try:
        pending = list(procs)
        while pending:
            time.sleep(0.05)
            for p in [p for p in pending if p.poll() is not None]:
                pending.remove(p)
                if p.returncode and not failed:
                    failed = p.returncode if p.returncode > 0 else 128 - p.returncode
                    which = procs.index(p)
                    for other in pending:  # the merge needs every part: the rest is wasted work
                        with contextlib.suppress(ProcessLookupError):
                            other.terminate()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    if received:
        raise KeyboardInterrupt
    return failed, which
