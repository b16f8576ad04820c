"""ShardReader: one loader reader's access to tar samples, tolerant of corrupt input.

A request for sample j of shard s is served from a sequential stream of the shard (webdataset's
tar iterator over an fsspec file: one open and one pass per shard) when the requests come in
file order, which is what an unshuffled split does; otherwise by random access (byte offsets
from the tar headers, the file kept open), which is what a shuffled order needs.

Bad input never raises here: a truncated or unreadable tar, a missing member, an array that does
not decode, or doc_lens that disagree with the tokens make the affected samples *bad*. Each
event is warned about once, counted in `failures`, and its samples are added to `bad` so the
resume arithmetic of the stream can treat them as empty (the data are corrupt on disk, so an
uninterrupted run skips them too). The stream stops the run after `max_failures` events.
"""

from __future__ import annotations

import io
import re
import tarfile
import warnings
from typing import Any, Iterator, Optional

import fsspec
import numpy as np
from webdataset.tariterators import group_by_keys, tar_file_iterator

Sample = tuple[np.ndarray, np.ndarray]  # (tokens, doc_lens)
MEMBERS = ("tokens.npy", "doc_lens.npy")


_NPY_HEADER = re.compile(rb"\{'descr': '([<>|]?[ui][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}")


def load_npy(data: bytes) -> np.ndarray:
    """np.load for the 1-D integer arrays the writer makes, without np.load's literal_eval of the
    header (which was most of the time spent per sample); anything else goes to np.load."""
    if data[:8] == b"\x93NUMPY\x01\x00":
        end = 10 + int.from_bytes(data[8:10], "little")
        m = _NPY_HEADER.match(data, 10, end)
        if m is not None:
            dtype = np.dtype(m.group(1).decode())
            count = int(m.group(2))
            if len(data) - end != count * dtype.itemsize:
                raise ValueError(f"array of {count} x {dtype} has {len(data) - end} bytes")
            return np.frombuffer(data, dtype, count, offset=end)
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_sample(parts: dict[str, bytes], where: str) -> Sample:
    """Member bytes -> (tokens, doc_lens); ValueError naming `where` when they do not fit."""
    missing = [m for m in MEMBERS if m not in parts]
    if missing:
        raise ValueError(f"{where}: missing member(s) {missing}")
    try:
        tokens, lens = (load_npy(parts[m]) for m in MEMBERS)
    except Exception as exc:
        raise ValueError(f"{where}: undecodable array ({type(exc).__name__}: {exc})") from None
    if tokens.ndim != 1 or lens.ndim != 1 or int(lens.sum()) != len(tokens):
        raise ValueError(f"{where}: doc_lens sum {int(lens.sum())} != {len(tokens)} tokens")
    return tokens, lens


def _sample_index(key: str, fallback: int) -> int:
    """The writer's keys end in -NNNNNN (the sample number); other keys count in file order."""
    tail = key.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else fallback


class ShardReader:
    def __init__(self, urls: list[str], n_samples: list[int]):
        self.urls, self.n_samples = urls, n_samples
        self.failures = 0
        self.bad: set[tuple[int, int]] = set()
        self.new_bad: list[tuple[int, int]] = []  # since the stream last collected them
        self._cursor: Optional[tuple[int, int, Iterator[tuple[int, Optional[Sample]]]]] = None
        self._tables: dict[int, dict[int, dict[str, tuple[int, int]]]] = {}
        self._files: dict[int, Any] = {}

    # ------------------------------------------------------------------ failures

    def _fail(self, s: int, samples: list[int], message: str) -> None:
        fresh = [(s, j) for j in samples if (s, j) not in self.bad]
        if not fresh:
            return
        self.failures += 1
        self.bad.update(fresh)
        self.new_bad.extend(fresh)
        warnings.warn(f"skipping {len(fresh)} sample(s) of {self.urls[s]}: {message}", stacklevel=3)

    # ------------------------------------------------------------------ access

    def sample(self, s: int, j: int) -> Optional[Sample]:
        """Sample j of shard s, or None when it is bad."""
        if (s, j) in self.bad:
            return None
        cursor = self._cursor
        if cursor is not None and cursor[0] == s and cursor[1] == j:
            return self._advance()
        if j == 0:  # a shard read from its start: stream it
            self._cursor = (s, 0, self._sequential(s))
            return self._advance()
        return self._random_access(s, j)

    def _advance(self) -> Optional[Sample]:
        assert self._cursor is not None
        s, j, it = self._cursor
        for got, sample in it:  # samples the stream skipped over are bad already
            if got >= j:
                self._cursor = (s, got + 1, it)
                return sample if got == j else None
        self._cursor = None
        return None

    def _sequential(self, s: int) -> Iterator[tuple[int, Optional[Sample]]]:
        """(j, sample or None) in file order; marks what it cannot read as bad."""
        url, seen = self.urls[s], -1
        try:
            with fsspec.open(url, "rb") as f:
                files = ({**d, "__url__": url} for d in tar_file_iterator(f))
                for n, parts in enumerate(group_by_keys(files)):
                    j = _sample_index(parts["__key__"], n)
                    if j > seen + 1:
                        self._fail(s, list(range(seen + 1, j)), "samples missing from the tar")
                    seen = max(seen, j)
                    try:
                        yield j, decode_sample(parts, f"{url}: sample {parts['__key__']!r}")
                    except ValueError as exc:
                        self._fail(s, [j], str(exc))
                        yield j, None
        except Exception as exc:  # truncated or corrupt tar (tarfile, EOF, network)
            self._fail(s, list(range(seen + 1, self.n_samples[s])),
                       f"unreadable after sample {seen} ({type(exc).__name__}: {exc})")
            return
        if seen + 1 < self.n_samples[s]:
            self._fail(s, list(range(seen + 1, self.n_samples[s])),
                       f"tar ends after {seen + 1} of {self.n_samples[s]} samples (truncated?)")

    def _table(self, s: int) -> dict[int, dict[str, tuple[int, int]]]:
        """sample -> {member: (byte offset, size)} from the tar headers, as far as they read."""
        if s not in self._tables:
            table: dict[int, dict[str, tuple[int, int]]] = {}
            keys: dict[str, int] = {}
            try:
                with fsspec.open(self.urls[s], "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
                    while (member := tar.next()) is not None:
                        if member.isfile():
                            key, _, ext = member.name.partition(".")
                            j = keys.setdefault(key, _sample_index(key, len(keys)))
                            table.setdefault(j, {})[ext] = (member.offset_data, member.size)
            except Exception as exc:
                self._fail(s, [j for j in range(self.n_samples[s]) if j not in table],
                           f"tar headers unreadable ({type(exc).__name__}: {exc})")
            self._tables[s] = table
        return self._tables[s]

    def _random_access(self, s: int, j: int) -> Optional[Sample]:
        entry = self._table(s).get(j)
        where = f"{self.urls[s]}: sample {j}"
        try:
            if entry is None:
                raise ValueError(f"{where}: not in the tar")
            if s not in self._files:
                self._files[s] = fsspec.open(self.urls[s], "rb").open()
            f, parts = self._files[s], {}
            for ext, (offset, size) in entry.items():
                f.seek(offset)
                parts[ext] = f.read(size)
                if len(parts[ext]) != size:
                    raise ValueError(f"{where}: member {ext} cut short (truncated tar)")
            return decode_sample(parts, where)
        except Exception as exc:
            self._fail(s, [j], str(exc))
            return None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cursor = None
