"""ShardReader: one loader reader's access to tar samples, tolerant of corrupt input.

A local shard is memory-mapped and a sample read in place at its table's offsets; a remote one
streamed in file order, else one ranged read per sample, a few at once (`prefetch`). A sample
that cannot be read or decoded is *bad*: one line on stderr, counted in `failures`, added to `bad`
(resume counts it empty); the event past `max_failures` is an InputError (exit 65) naming them.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any, Iterator, Optional

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from scse_dist.cli_errors import InputError
from scse_dist.data.index import tar_samples
from scse_dist.data.sample_format import MEMBERS, Sample, decode_sample, load_sample_table


def documents_of(sample: Sample) -> list[np.ndarray]:
    """A sample's documents, each without its eos."""
    tokens, lens = sample
    ends = np.cumsum(lens + 1, dtype=np.int64)
    return [tokens[e - n - 1:e - 1] for e, n in zip(ends.tolist(), lens.tolist())]


class ShardReader:
    def __init__(self, urls: list[str], n_samples: list[int], eos: int, vocab_size: int,
                 table_urls: list[str], file_order: bool = False, max_failures: int = 100):
        """`vocab_size`: the index's, no id may reach it. `file_order`: samples are asked for in
        file order (an unshuffled split), so a remote shard is streamed, not read by ranges."""
        self.urls, self.n_samples, self.eos, self.table_urls = urls, n_samples, eos, table_urls
        self.vocab_size, self.max_failures = vocab_size, max_failures
        self.file_order = file_order
        self._prefetched: dict[tuple[int, int], memoryview] = {}
        self._sample_tables: dict[int, Optional[np.ndarray]] = {}  # None: unreadable
        self.failures = 0
        self.bad: set[tuple[int, int]] = set()
        self.new_bad: list[tuple[int, int]] = []  # since the stream last collected them
        self._cursor: Optional[tuple[int, int, Iterator[tuple[int, Optional[Sample]]]]] = None
        self._sources: dict[int, Any] = {}  # shard -> mmap view, or (filesystem, path)

    def _fail(self, s: int, samples: list[int], message: str) -> None:
        fresh = [(s, j) for j in samples if (s, j) not in self.bad]
        if not fresh:
            return
        self.failures += 1
        message = message.removeprefix(f"{self.urls[s]}: ")  # named below, once
        first, last = fresh[0][1], fresh[-1][1]
        where = f"{self.urls[s]}: " + ("" if message.startswith("sample ") else
                                      f"sample {first}: " if first == last else
                                      f"samples {first}..{last}: ")
        if self.failures > self.max_failures:
            raise InputError(f"{where}{message} ({self.failures} bad shards/samples, more than "
                             f"data.max_failures={self.max_failures}): repair or rebuild the "
                             "shards (or raise data.max_failures)")
        self.bad.update(fresh)
        self.new_bad.extend(fresh)
        print(f"skipping {len(fresh)} bad sample(s): {where}{message}", file=sys.stderr,
              flush=True)

    def sample(self, s: int, j: int) -> Optional[Sample]:
        """Sample j of shard s, or None when it is bad."""
        if (s, j) in self.bad:
            return None
        cursor = self._cursor
        if cursor is not None and cursor[0] == s and cursor[1] == j:
            return self._advance()
        source = self._source(s)
        if source is None:
            return None
        if j == 0 and self.file_order and not isinstance(source, memoryview):  # remote, in order
            self._cursor = (s, 0, self._sequential(s))
            return self._advance()
        return self._random_access(s, j)

    def prefetch(self, keys: list[tuple[int, int]]) -> None:
        """Fetch these samples of remote shards in one concurrent `cat_ranges` call (async
        filesystems such as s3fs send the GETs in parallel), for the sample() calls to come:
        one request at a time would leave a reader waiting a round trip per 64K tokens."""
        if self.file_order:
            return
        by_fs: dict[int, tuple[Any, list[tuple[tuple[int, int], str, int, int]]]] = {}
        for s, j in dict.fromkeys(keys):
            if (s, j) in self.bad or (s, j) in self._prefetched:
                continue
            source = self._source(s)
            if isinstance(source, tuple):  # remote and readable (so its table loaded)
                lo, hi, _ = self._location(s, j)
                by_fs.setdefault(id(source[0]), (source[0], []))[1].append(
                    ((s, j), source[1], lo, hi))
        for fs, ranges in by_fs.values():
            blobs = fs.cat_ranges([r[1] for r in ranges], [r[2] for r in ranges],
                                  [r[3] for r in ranges], on_error="return")
            for (key, _, lo, hi), blob in zip(ranges, blobs):
                if isinstance(blob, bytes) and len(blob) == hi - lo:  # else sample() reads it again
                    self._prefetched[key] = memoryview(blob)

    def sample_table(self, s: int) -> Optional[np.ndarray]:
        """Shard s's sample table, loaded once; None, with all the shard's samples made bad,
        when it is unreadable (then every path skips the shard alike)."""
        if s not in self._sample_tables:
            self._sample_tables[s] = None
            try:
                self._sample_tables[s] = load_sample_table(self.table_urls[s], self.n_samples[s])
            except (ValueError, OSError) as exc:
                self._fail(s, list(range(self.n_samples[s])), str(exc))
        return self._sample_tables[s]

    def _source(self, s: int) -> Any:
        """A read-only mmap view of a local shard (the page cache read in place, not copied), or
        (filesystem, path) of a remote one; None, with all its samples bad, when it won't open."""
        if s not in self._sources:
            if self.sample_table(s) is None:  # a bad table: the shard is bad in every read order
                self._sources[s] = None
                return None
            try:
                fs, path = fsspec.core.url_to_fs(self.urls[s])
                if isinstance(fs, LocalFileSystem):
                    with open(path, "rb") as f:
                        self._sources[s] = memoryview(
                            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                else:
                    self._sources[s] = (fs, path)
            except Exception as exc:  # gone since start-up, empty, unreadable
                self._sources[s] = None
                self._fail(s, list(range(self.n_samples[s])),
                           f"cannot open ({type(exc).__name__}: {exc})")
        return self._sources[s]

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
                for n, parts in enumerate(tar_samples(f, url)):
                    tail = parts["__key__"].rsplit("-", 1)[-1]  # the writer's: -NNNNNN, sample j
                    j = int(tail) if tail.isdigit() else n
                    if j > seen + 1:
                        self._fail(s, list(range(seen + 1, j)), "samples missing from the tar")
                    seen = max(seen, j)
                    try:
                        yield j, decode_sample(parts, f"{url}: sample {parts['__key__']!r}",
                                               self.eos, self.vocab_size)
                    except ValueError as exc:
                        self._fail(s, [j], str(exc))
                        yield j, None
        except InputError:  # past max_failures
            raise
        except Exception as exc:  # truncated or corrupt tar (tarfile, EOF, network)
            self._fail(s, list(range(seen + 1, self.n_samples[s])),
                       f"unreadable after sample {seen} ({type(exc).__name__}: {exc})")
            return
        if seen + 1 < self.n_samples[s]:
            self._fail(s, list(range(seen + 1, self.n_samples[s])),
                       f"tar ends after {seen + 1} of {self.n_samples[s]} samples (truncated?)")

    def _location(self, s: int, j: int) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """(lo, hi, {member: (byte offset, size)}) of sample j of shard s, from its (loaded) sample
        table; [lo, hi) spans both members and the tar header between them."""
        table = self._sample_tables[s]
        assert table is not None
        _, _, t, tn, d, dn = table[j].tolist()
        return min(t, d), max(t + tn, d + dn), {MEMBERS[0]: (t, tn), MEMBERS[1]: (d, dn)}

    def _random_access(self, s: int, j: int) -> Optional[Sample]:
        where = f"{self.urls[s]}: sample {j}"
        try:
            lo, hi, members = self._location(s, j)
            blob = self._prefetched.pop((s, j), None)
            if blob is None:
                blob = self._read_range(s, lo, hi)
            if len(blob) != hi - lo:
                raise ValueError(f"{where}: {len(blob)} of {hi - lo} bytes (truncated tar)")
            parts = {ext: blob[offset - lo:offset - lo + size]
                     for ext, (offset, size) in members.items()}
            return decode_sample(parts, where, self.eos, self.vocab_size)
        except Exception as exc:
            self._fail(s, [j], str(exc))
            return None

    def _read_range(self, s: int, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of shard s: an mmap slice, or one ranged read (one GET) when remote."""
        source = self._source(s)
        if isinstance(source, memoryview):
            return source[lo:hi]
        fs, path = source
        return memoryview(fs.cat_file(path, start=lo, end=hi))

    def close(self) -> None:
        # mmaps close when the last array viewing them goes: closing here could pull pages from
        # under a batch still in use
        self._sources.clear()
        self._prefetched.clear()
        self._cursor = None
