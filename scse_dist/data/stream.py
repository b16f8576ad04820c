"""TokenStream: packed (batch, seq_len + 1) LongTensor batches from scse-tokens-v1 shards.

Packing: every document is followed by eos and the documents are laid end to end into one long
token stream per rank, cut into consecutive, non-overlapping windows of seq_len + 1 tokens
(inputs = w[:, :-1], targets = w[:, 1:]); `batch_size` consecutive windows make a batch. In the
looping train split the stream runs on across epoch boundaries, so no token is wasted.

Rank split, at the coarsest level that gives every rank something: whole shards when there are
at least `world_size` of them, else tar samples (read by random access into the tar), else
single documents (only for tiny splits, which are then cached in memory). Fewer documents than
ranks is an error, never a silently idle rank.

Order: train shuffles the unit order each epoch with rng(seed, epoch) (units are split across
ranks after the shuffle, so every rank sees fresh data each epoch) and, for whole-shard units,
the sample order inside each shard with rng(seed, epoch, shard) (the shard is read into memory
for that: one shard at a time); documents inside a sample keep their order. heldout defaults to no shuffle and, with loop=False, is finite and identical
on every run; its last batch may hold fewer rows (no full window is dropped).

Resume: every rank yields one batch per call in lock-step, so the position is one number, the
batches consumed, identical on all ranks. `load_state_dict` turns it back into (epoch, unit,
offset) arithmetically from the index's token counts, so resuming skips without decoding.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Iterator, Optional

import fsspec
import numpy as np
import torch

from scse_dist.data.shards import iter_samples, read_index, sample_table, shard_url

Unit = tuple[int, int, int]  # (shard, sample or -1 for all, document or -1 for all)
STATE_KEYS = ("split", "seq_len", "batch_size", "world_size", "seed")


class TokenStream:
    def __init__(self, path: str, split: str = "train", seq_len: int = 256, batch_size: int = 8,
                 rank: int = 0, world_size: int = 1, seed: int = 0, loop: bool = True,
                 tokenizer_sha256: Optional[str] = None, shuffle: Optional[bool] = None):
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be > 0, got {seq_len}, {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must lie in [0, world_size={world_size}), got {rank}")
        self.path, self.split, self.seq_len, self.batch_size = path.rstrip("/"), split, seq_len, batch_size
        self.rank, self.world_size, self.seed, self.loop = rank, world_size, seed, loop
        self.shuffle = (split == "train") if shuffle is None else shuffle
        self.index = read_index(self.path)
        if tokenizer_sha256 is not None and tokenizer_sha256 != self.index["tokenizer_sha256"]:
            raise ValueError(f"tokenizer mismatch for {self.path}: the model's tokenizer has sha256 "
                             f"{tokenizer_sha256}, but the shards were written with "
                             f"{self.index['tokenizer_sha256']}")
        if split not in self.index["splits"]:
            raise ValueError(f"{self.path}: no split {split!r} (has {sorted(self.index['splits'])})")
        self.shards = [s for s in self.index["splits"][split] if s["tokens"] > 0]
        self.urls = [shard_url(self.path, s) for s in self.shards]
        self.eos = int(self.index["eos_id"])
        n_docs = sum(s["documents"] for s in self.shards)
        if n_docs < world_size:
            raise ValueError(f"{self.path}: split {split!r} has {n_docs} documents, fewer than "
                             f"world_size={world_size}; every rank needs data")
        self._tables: dict[int, list[dict[str, tuple[int, int]]]] = {}  # shard -> sample offsets
        self._lens: dict[tuple[int, int], np.ndarray] = {}  # (shard, sample) -> doc_lens
        self._memory: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # tiny splits
        self.level = self._pick_level()
        self.consumed = 0  # batches yielded so far (the whole resume state)
        self.epoch = 0

    # ------------------------------------------------------------------ units

    def _samples_in(self, s: int) -> int:
        if "samples" in self.shards[s]:
            return int(self.shards[s]["samples"])
        return len(self._table(s))

    def _pick_level(self) -> str:
        if len(self.shards) >= self.world_size:
            return "shard"
        if sum(self._samples_in(s) for s in range(len(self.shards))) >= self.world_size:
            return "sample"
        return "document"

    def _all_units(self) -> list[Unit]:
        if self.level == "shard":
            return [(s, -1, -1) for s in range(len(self.shards))]
        samples = [(s, j) for s in range(len(self.shards)) for j in range(self._samples_in(s))]
        if self.level == "sample":
            return [(s, j, -1) for s, j in samples]
        return [(s, j, d) for s, j in samples for d in range(len(self._doc_lens(s, j)))]

    def epoch_units(self, epoch: int) -> list[Unit]:
        """The units this rank reads in `epoch`, in order (shuffle first, then deal to ranks)."""
        units = self._all_units()
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(units))
            units = [units[i] for i in order]
        return units[self.rank::self.world_size]

    # ------------------------------------------------------------------ reading

    def _table(self, s: int) -> list[dict[str, tuple[int, int]]]:
        if s not in self._tables:
            self._tables[s] = sample_table(self.urls[s])
        return self._tables[s]

    def _read_member(self, s: int, j: int, ext: str) -> np.ndarray:
        offset, size = self._table(s)[j][ext]
        with fsspec.open(self.urls[s], "rb") as f:
            f.seek(offset)
            data = f.read(size)
        return np.load(io.BytesIO(data), allow_pickle=False)

    def _doc_lens(self, s: int, j: int) -> np.ndarray:
        if (s, j) not in self._lens:
            self._lens[(s, j)] = self._read_member(s, j, "doc_lens.npy")
        return self._lens[(s, j)]

    def _sample(self, s: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        if self.level == "document":  # tiny split: read each sample once, keep it
            if (s, j) not in self._memory:
                self._memory[(s, j)] = (self._read_member(s, j, "tokens.npy"), self._doc_lens(s, j))
            return self._memory[(s, j)]
        return self._read_member(s, j, "tokens.npy"), self._doc_lens(s, j)

    def _unit_samples(self, unit: Unit, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(tokens, doc_lens) pieces of one unit, in order."""
        s, j, d = unit
        if j < 0 and not self.shuffle:
            for _, tokens, lens in iter_samples(self.urls[s]):
                yield tokens, lens
            return
        if j < 0:  # a shuffled shard: read it whole, then visit its samples in a seeded order
            samples = [(tokens, lens) for _, tokens, lens in iter_samples(self.urls[s])]
            rng = np.random.default_rng([self.seed, epoch, s])
            for i in rng.permutation(len(samples)):
                yield samples[i]
            return
        tokens, lens = self._sample(s, j)
        if d < 0:
            yield tokens, lens
        else:
            start = int(lens[:d].sum())
            yield tokens[start:start + int(lens[d])], lens[d:d + 1]

    def _unit_size(self, unit: Unit) -> int:
        """Packed length (tokens plus one eos per document) without reading tokens."""
        s, j, d = unit
        if j < 0:
            return int(self.shards[s]["tokens"]) + int(self.shards[s]["documents"])
        lens = self._doc_lens(s, j)
        return (int(lens.sum()) + len(lens)) if d < 0 else int(lens[d]) + 1

    def documents(self, epoch: int = 0) -> Iterator[np.ndarray]:
        """This rank's documents in `epoch`, unpacked (no eos), in reading order."""
        for unit in self.epoch_units(epoch):
            for tokens, lens in self._unit_samples(unit, epoch):
                yield from np.split(tokens, np.cumsum(lens, dtype=np.int64)[:-1])

    def _packed(self, unit: Unit, epoch: int) -> Iterator[np.ndarray]:
        for tokens, lens in self._unit_samples(unit, epoch):
            # One vectorised insert: eos after every document.
            yield np.insert(tokens.astype(np.int64), np.cumsum(lens, dtype=np.int64), self.eos)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[torch.Tensor]:
        width = self.seq_len + 1
        need = self.batch_size * width
        skip = self.consumed * need  # tokens of this rank's stream already consumed
        epoch = 0
        buf: list[np.ndarray] = []
        buffered = 0
        while True:
            units = self.epoch_units(epoch)
            if skip:
                total = sum(self._unit_size(u) for u in units)
                if skip >= total:  # the whole epoch was consumed before the resume point
                    skip -= total
                    epoch += 1
                    if not self.loop:
                        return
                    continue
            self.epoch = epoch
            for unit in units:
                if skip:
                    size = self._unit_size(unit)
                    if skip >= size:
                        skip -= size
                        continue
                for packed in self._packed(unit, epoch):
                    if skip:
                        cut = min(skip, len(packed))
                        packed, skip = packed[cut:], skip - cut
                    buf.append(packed)
                    buffered += len(packed)
                    if buffered >= need:
                        flat = np.concatenate(buf)
                        n = len(flat) // need
                        rest = flat[n * need:]
                        buf, buffered = [rest], len(rest)
                        for i in range(n):
                            self.consumed += 1
                            yield torch.from_numpy(flat[i * need:(i + 1) * need].reshape(self.batch_size, width))
            epoch += 1
            if not self.loop:
                flat = np.concatenate(buf) if buf else np.zeros(0, np.int64)
                rows = len(flat) // width
                if rows:  # the last, smaller batch: keep every full held-out window
                    self.consumed += 1
                    yield torch.from_numpy(flat[: rows * width].reshape(rows, width))
                elif self.consumed == 0:
                    warnings.warn(f"{self.path}: rank {self.rank} of {self.world_size} holds fewer "
                                  f"than {width} tokens of split {self.split!r}: no batch at all")
                return

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """The same on every rank (lock-step batches), so rank 0's copy resumes them all."""
        state = {k: getattr(self, k) for k in STATE_KEYS}
        state.update(consumed_batches=self.consumed, epoch=self.epoch,
                     tokenizer_sha256=self.index["tokenizer_sha256"])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in STATE_KEYS:
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume data stream: {key} was {state[key]!r}, now "
                                 f"{getattr(self, key)!r} (the batch sequence would differ)")
        if state.get("tokenizer_sha256", self.index["tokenizer_sha256"]) != self.index["tokenizer_sha256"]:
            raise ValueError(f"cannot resume data stream: shards at {self.path} were rewritten with "
                             f"another tokenizer ({state['tokenizer_sha256']} -> "
                             f"{self.index['tokenizer_sha256']})")
        self.consumed = int(state["consumed_batches"])
        self.epoch = int(state.get("epoch", 0))
