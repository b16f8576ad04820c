"""Token shards, format "scse-tokens-v2" (docs/data.md, "The shard format"): per split, WebDataset
tars of samples, each whole documents as `{key}.tokens.npy` (the packed training stream: each
document followed by eos) and `{key}.doc_lens.npy`; beside each tar its sample table (sizes a
resume skips by, offsets a shuffled read seeks to: out of index.json, which stays small); and
index.json. The held-out split goes by a hash of each text alone (stable, never in train too).
Written by the write rule (scse_dist.atomic.output_dir): in a folder beside `out`, moved into
place when complete, index.json last.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import tarfile
from typing import Any, ContextManager, Iterable

import fsspec
import numpy as np

from scse_dist.atomic import output_dir
from scse_dist.cli_errors import InputError
from scse_dist.data.index import INDEX_NAME, SPLITS, index_as_written, join
from scse_dist.data.sample_format import (  # noqa: F401
    FORMAT,
    TABLE_COLUMNS,
    decode_sample,
    load_sample_table,
    npy_bytes,
)
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.progress import Progress
from scse_dist.typed_yaml import ConfigError


def is_heldout(text: str, fraction: float) -> bool:
    """Deterministic split by content: sha1(text) as a number in [0, 1) below `fraction`."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha1(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class _SplitWriter:
    """Collects one split's documents into samples and rolls samples into tar shards."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, split: str, dtype: str,
                 eos: int, sample_tokens: int, shard_bytes: int):
        self.fs, self.root, self.split, self.dtype, self.eos = fs, root, split, np.dtype(dtype), eos
        self.sample_tokens, self.shard_bytes = sample_tokens, shard_bytes
        self.docs: list[Any] = []  # token id lists, or arrays (merge_parts)
        self.doc_tokens = 0
        self.shards: list[dict[str, Any]] = []
        self.table: list[list[int]] = []  # the open shard's sample table, a row per sample
        self.tar: tarfile.TarFile | None = None
        self.file: Any = None
        self.shard_written = 0

    def add(self, ids: Any) -> None:
        self.docs.append(ids)
        self.doc_tokens += len(ids)
        if self.doc_tokens >= self.sample_tokens:
            self._flush_sample()

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self.file = self.fs.open(join(self.root, name), "wb")
        self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT)
        self.shards.append({"url": name, "table": name[:-len(".tar")] + ".samples.npy",
                            "tokens": 0, "documents": 0, "samples": 0})
        self.table = []
        self.shard_written = 0

    def _add_member(self, name: str, data: bytes) -> list[int]:
        """Append a member; return [its data's byte offset in the tar, its size]."""
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o444  # mtime 0: reproducible bytes
        assert self.tar is not None
        self.tar.addfile(info, io.BytesIO(data))
        self.shard_written += len(data) + 1024  # payload plus headers, roughly
        padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # addfile pads the data
        return [self.tar.offset - padded, len(data)]

    def _flush_sample(self) -> None:
        if not self.docs:
            return
        if self.tar is None:
            self._open_shard()
        shard = self.shards[-1]
        key = f"{self.split}-{len(self.shards) - 1:06d}-{shard['samples']:06d}"
        lens = np.array([len(d) for d in self.docs], dtype=np.uint32)
        if isinstance(self.docs[0], np.ndarray):  # from merge_parts: slices of a part's tokens
            tokens = np.concatenate(self.docs).astype(self.dtype, copy=False)
        else:
            tokens = np.fromiter(itertools.chain.from_iterable(self.docs), dtype=self.dtype,
                                 count=self.doc_tokens)
        tokens = np.insert(tokens, np.cumsum(lens, dtype=np.int64), self.eos)
        row = [self.doc_tokens, len(self.docs)]
        row += self._add_member(f"{key}.tokens.npy", npy_bytes(tokens))
        row += self._add_member(f"{key}.doc_lens.npy", npy_bytes(lens))
        self.table.append(row)
        shard["tokens"] += self.doc_tokens
        shard["documents"] += len(self.docs)
        shard["samples"] += 1
        self.docs, self.doc_tokens = [], 0
        if self.shard_written >= self.shard_bytes:
            self._close_shard()

    def _close_shard(self) -> None:
        if self.tar is None:
            return
        self.tar.close()
        self.file.close()
        with self.fs.open(join(self.root, self.shards[-1]["table"]), "wb") as f:
            f.write(npy_bytes(np.array(self.table, dtype=np.int64).reshape(-1, len(TABLE_COLUMNS))))
        self.tar = self.file = None

    def finish(self) -> list[dict[str, Any]]:
        self._flush_sample()
        self._close_shard()
        return self.shards


_worker_tokenizer: Any = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer  # each kind pickles as its file's bytes (__reduce__)


def _encode_in_worker(batch: list[str]) -> tuple[list[str], list[list[int]]]:
    return batch, _worker_tokenizer.encode_batch(batch, num_threads=1)


def check_layout(heldout_fraction: float, sample_tokens: int, shard_bytes: int) -> None:
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction: must lie in [0, 1), got {heldout_fraction}")
    if sample_tokens <= 0 or shard_bytes <= 0:
        raise ConfigError(f"sample_tokens and shard_bytes must be > 0, got {sample_tokens}, "
                          f"{shard_bytes}")


def tokenize_into(documents: Iterable[str], tokenizer: Tokenizer, writers: dict[str, Any],
                  heldout_fraction: float, what: str, encode_batch: int = 256,
                  progress_every: float = 0.0, workers: int = 0) -> int:
    """Encode `documents` and hand each one's ids to its split's writer (`.add(ids)`), in input
    order; return the number of documents written (those that encode to nothing are skipped)."""
    n_docs = n_tokens = 0
    progress = Progress(None, what, unit="doc", enabled=progress_every > 0,
                        every_s=progress_every)
    docs = iter(documents)
    batches = iter(lambda: list(itertools.islice(docs, encode_batch)), [])
    if workers > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_worker, initargs=(tokenizer,))
        encoded: Iterable = pool.imap(_encode_in_worker, batches, chunksize=1)
    else:
        pool = None
        encoded = ((b, tokenizer.encode_batch(b)) for b in batches)
    try:
        for batch, batch_ids in encoded:
            kept = 0
            for text, ids in zip(batch, batch_ids):
                if len(ids):
                    writers["heldout" if is_heldout(text, heldout_fraction) else "train"].add(ids)
                    n_docs, n_tokens, kept = n_docs + 1, n_tokens + len(ids), kept + 1
            progress.set_postfix(tokens=f"{n_tokens:,}",
                                 tokens_per_s=f"{n_tokens / max(progress.elapsed, 1e-9):,.0f}")
            progress.update(kept)
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    return n_docs


def no_documents(out: str) -> InputError:
    # an index of nothing would let a job "train" on no data
    return InputError(f"{out}: no documents to write (the inputs are empty, or no document "
                      "encodes to a token)")


def shards_output(out: str) -> ContextManager[str]:
    """The context in which a command writes shards: a temporary folder that becomes `out` when
    the body succeeds (scse_dist.atomic.output_dir); a folder holding a shard index of any version
    is scse-data's, so its files may be replaced."""
    return output_dir(out, lambda url: str((index_as_written(url) or {}).get("format", ""))
                      .startswith("scse-tokens"), INDEX_NAME)


def split_writers(fs: fsspec.AbstractFileSystem, root: str, dtype: str, eos: int,
                  sample_tokens: int, shard_bytes: int) -> dict[str, _SplitWriter]:
    return {s: _SplitWriter(fs, root, s, dtype, eos, sample_tokens, shard_bytes) for s in SPLITS}


def finish_index(fs: fsspec.AbstractFileSystem, root: str, writers: dict[str, _SplitWriter],
                 meta: dict) -> dict:
    """Close the shards, then write index.json; `meta` holds the fields of index.json other than
    "splits" and "format"."""
    index = {"format": FORMAT, **{k: meta[k] for k in ("tokenizer_sha256", "vocab_size",
                                                       "eos_id", "dtype", "sample_tokens")},
             "splits": {s: w.finish() for s, w in writers.items()},
             "sources": list(meta["sources"])}
    with fs.open(join(root, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=1)
    return index


def shard_meta(tokenizer: Tokenizer, sample_tokens: int, sources: list[str] | None) -> dict:
    vocab = tokenizer.vocab_size
    return {"tokenizer_sha256": tokenizer.sha256, "vocab_size": vocab, "eos_id": tokenizer.eos_id,
            "dtype": "uint16" if vocab <= 2**16 else "uint32", "sample_tokens": sample_tokens,
            "sources": list(sources or [])}


def write_shards(documents: Iterable[str], tokenizer: Tokenizer, out: str,
                 heldout_fraction: float = 0.0, shard_bytes: int = 256 * 2**20,
                 sample_tokens: int = 65536, sources: list[str] | None = None,
                 encode_batch: int = 256, progress_every: float = 0.0, workers: int = 0) -> dict:
    """Tokenize `documents` into train/heldout shards under `out`; write and return the index.
    `progress_every` > 0: progress at most that often (s). `workers` > 1: tokenizer processes,
    batches back in input order, so the shards are the bytes of workers=0."""
    check_layout(heldout_fraction, sample_tokens, shard_bytes)
    meta = shard_meta(tokenizer, sample_tokens, sources)
    with shards_output(out) as tmp:
        fs, root = fsspec.core.url_to_fs(tmp)
        writers = split_writers(fs, root, meta["dtype"], tokenizer.eos_id, sample_tokens,
                                shard_bytes)
        if tokenize_into(documents, tokenizer, writers, heldout_fraction, f"shards {out}",
                         encode_batch, progress_every, workers) == 0:
            raise no_documents(out)
        return finish_index(fs, root, writers, meta)
