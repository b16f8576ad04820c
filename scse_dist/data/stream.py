"""TokenStream: packed (batch, seq_len + 1) LongTensor batches from scse-tokens-v2 shards
(docs/data.md). Each (rank, DataLoader worker) is a *reader*, `rank * slots + worker`, reading the
items order.py deals it, its documents laid end to end (each with its stored eos) by a WindowPacker.

A rank's position is one number, the batches consumed (the DataLoader takes them from its workers
round robin); a restarted reader skips its tokens arithmetically from the sample tables' sizes (bad
samples count as empty), so the next batch is the one an uninterrupted run would give. At another
layout (`resume` with every rank's state), relayout.py.
"""

from __future__ import annotations

import json
import os
import warnings
from itertools import islice
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from scse_dist.cli_errors import InputError
from scse_dist.data.index import check_tokenizer, resolve_split, table_url
from scse_dist.data.order import Item, pick_level, reader_plan
from scse_dist.data.packing import WindowPacker
from scse_dist.data.reader import Sample, ShardReader, documents_of
from scse_dist.data.relayout import carried_items

PREFETCH_SAMPLES = 16  # remote samples fetched concurrently (~2 MB at 64K uint16 tokens)
STATE_KEYS = ("split", "seq_len", "batch_size", "seed", "shuffle_buffer")
# what the readers' orders depend on: fixed for a run. The other keys may change at a resume.
ORDER_KEYS = {"split": "the split", "seed": "train.seed", "shuffle_buffer": "data.shuffle_buffer"}
LAYOUT_KEYS = ("world_size", "num_workers", "batch_size", "seq_len")
LOG_SAMPLES_ENV = "SCSE_LOG_SAMPLES"  # a directory: every consumed sample start is logged there


class TokenStream:
    def __init__(self, path: str, split: str = "train", seq_len: int = 256, batch_size: int = 8,
                 rank: int = 0, world_size: int = 1, seed: int = 0, loop: bool = True,
                 tokenizer_sha256: Optional[str] = None, shuffle: Optional[bool] = None,
                 num_workers: int = 0, shuffle_buffer: int = 0, max_failures: int = 100):
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be > 0, got {seq_len}, {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must lie in [0, world_size={world_size}), got {rank}")
        if num_workers < 0 or shuffle_buffer < 0 or max_failures < 0:
            raise ValueError("data.num_workers, data.shuffle_buffer and data.max_failures must be "
                             f">= 0, got {num_workers}, {shuffle_buffer}, {max_failures}")
        self.path, self.split = path.rstrip("/"), split
        self.seq_len, self.batch_size = seq_len, batch_size
        self.rank, self.world_size, self.seed, self.loop = rank, world_size, seed, loop
        self.num_workers, self.shuffle_buffer = num_workers, shuffle_buffer
        self.max_failures = max_failures
        self.shuffle = (split == "train") if shuffle is None else shuffle
        self.root, self.index, self.shards, self.urls = resolve_split(self.path, split)
        if tokenizer_sha256 is not None:
            check_tokenizer(self.path, self.index, tokenizer_sha256)
        self.eos = int(self.index["eos_id"])
        self.slots = max(1, num_workers)
        self.n_readers = world_size * self.slots
        n_docs = sum(s["documents"] for s in self.shards)
        if n_docs < self.n_readers:
            raise InputError(f"{self.path}: split {split!r} has {n_docs} documents, fewer than the "
                             f"{self.n_readers} readers (world_size={world_size} x "
                             f"data.num_workers={num_workers}); every reader needs data")
        self.n_samples = [int(e["samples"]) for e in self.shards]
        self.tables = [table_url(self.root, e) for e in self.shards]
        self._probe = self._new_reader()
        self._memory: dict[tuple[int, int], Optional[Sample]] = {}  # document level only
        self.level = pick_level(self.n_samples, self.n_readers)
        self.consumed = 0  # batches this rank yielded in this layout: with it, the whole position
        self.bad: set[tuple[int, int]] = set()
        # `carry`: per epoch a layout change cut, the items no old reader consumed (relayout.py)
        self.origin: Optional[dict[str, Any]] = None
        self.carry: dict[int, list[Item]] = {}
        self.reader_epochs = [0] * self.slots
        self.reader_failures = [0] * self.slots
        self.log_dir = os.environ.get(LOG_SAMPLES_ENV)
        self._log: Any = None

    @classmethod
    def from_config(cls, data: Any, split: str, batch_size: int, rank: int, world_size: int,
                    seed: int, tokenizer_sha256: Optional[str]) -> Any:
        """The training stream of a DataConfig: one corpus, or a weighted mixture."""
        kw = dict(split=split, seq_len=data.seq_len, batch_size=batch_size, rank=rank,
                  world_size=world_size, seed=seed, loop=True, tokenizer_sha256=tokenizer_sha256,
                  num_workers=data.num_workers, shuffle_buffer=data.shuffle_buffer,
                  max_failures=data.max_failures)
        if not data.mixture_paths:
            return cls(data.path, **kw)
        from scse_dist.data.mixture import MixedStream

        return MixedStream([cls(p, **kw) for p in data.mixture_paths], data.mixture_weights, seed)

    @property
    def epoch(self) -> int:
        return min(self.reader_epochs)

    @property
    def failures(self) -> int:
        """Bad-input events (corrupt shards or samples skipped) on this rank so far."""
        return sum(self.reader_failures)

    def plan(self, reader: int, epoch: int, n_readers: Optional[int] = None) -> list[Item]:
        """The items `reader` of `n_readers` (default: this layout's) reads in a regular `epoch`."""
        return reader_plan(self, reader, epoch, n_readers or self.n_readers)

    @property
    def start_epoch(self) -> int:
        """The first epoch this layout's readers read (the oldest one a layout change cut)."""
        return min(self.carry, default=0)

    def epoch_items(self, reader: int, epoch: int) -> list[Item]:
        """What `reader` reads in `epoch`: its share of the carry, else its regular plan."""
        if epoch in self.carry:
            return self.carry[epoch][reader::self.n_readers]
        return self.plan(reader, epoch)

    def _doc_lens(self, s: int, j: int) -> np.ndarray:
        sample = self._sample(self._probe, s, j)
        return sample[1] if sample is not None else np.zeros(0, np.uint32)

    def _sample(self, reader: ShardReader, s: int, j: int) -> Optional[Sample]:
        if self.level != "document":
            return reader.sample(s, j)
        if (s, j) not in self._memory:  # tiny split: read each sample once, keep it
            self._memory[(s, j)] = reader.sample(s, j)
        return self._memory[(s, j)]

    def _item_size(self, item: Item, reader: ShardReader) -> int:
        """Packed length (tokens plus one eos per document), from the sample table where it can."""
        s, j, d, first = item
        table = reader.sample_table(s)
        if (s, j) in reader.bad:
            return 0
        if d >= 0:
            return int(self._doc_lens(s, j)[d]) + 1 - first
        assert table is not None  # else all of shard s is bad
        return int(table[j, 0] + table[j, 1]) - first

    def _new_reader(self) -> ShardReader:
        return ShardReader(self.urls, self.n_samples, self.eos, int(self.index["vocab_size"]),
                           self.tables, not self.shuffle, self.max_failures)

    def documents(self, epoch: int = 0, worker: int = 0) -> Iterator[np.ndarray]:
        """One reader's documents in `epoch`, unpacked (no eos), in reading order."""
        reader = self._probe = self._new_reader()
        for s, j, d, _ in self.plan(self.rank * self.slots + worker, epoch):
            sample = self._sample(reader, s, j)
            if sample is not None:
                docs = documents_of(sample)
                yield from (docs if d < 0 else docs[d:d + 1])

    def _packed(self, reader: ShardReader, item: Item) -> Optional[np.ndarray]:
        s, j, d, first = item
        sample = self._sample(reader, s, j)
        if sample is None:
            return None
        tokens, lens = sample  # tokens are packed already: each document followed by eos
        if d >= 0:
            start = int(lens[:d].sum()) + d
            tokens = tokens[start:start + int(lens[d]) + 1]
        return tokens[first:]  # a layout change carried over this item's unread tail

    def reader_batches(self, slot: int, skip_batches: int, bad: set[tuple[int, int]]
                       ) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(batch, progress) of reader slot `slot` of this rank, after `skip_batches` batches."""
        # a fresh reader per process: open files are never shared by a fork
        reader = self._probe = self._new_reader()
        reader.bad, reader.failures = set(bad), self.reader_failures[slot]  # as restored
        width = self.seq_len + 1
        packer = WindowPacker(self.batch_size, width)
        skip = skip_batches * packer.size  # tokens of this reader's stream already consumed
        epoch, yielded = self.start_epoch, 0
        state: dict[str, Any] = {}
        # SCSE_LOG_SAMPLES: [epoch, shard, sample, doc] of each item, by the window its first
        # token is in
        starts: Optional[dict[int, list[list[int]]]] = {} if self.log_dir else None

        def progress() -> dict[str, Any]:
            """The reader's state; the same object while it is unchanged (cheap to skip)."""
            nonlocal state
            if reader.new_bad or state.get("epoch") != epoch or \
                    state["failures"] != reader.failures:
                new, reader.new_bad = reader.new_bad, []
                state = {"slot": slot, "epoch": epoch, "failures": reader.failures, "bad": new}
            return state

        while True:
            epoch_has_data = False
            items, fetched_to = self.epoch_items(self.rank * self.slots + slot, epoch), 0
            for i, item in enumerate(items):
                if skip:
                    size = self._item_size(item, reader)
                    if skip >= size:
                        skip -= size
                        epoch_has_data |= size > 0
                        continue
                if i >= fetched_to and self.level != "document":  # remote: the next few at once
                    fetched_to = i + PREFETCH_SAMPLES
                    reader.prefetch([(s, j) for s, j, _, _ in items[i:fetched_to]])
                packed = self._packed(reader, item)  # past data.max_failures: InputError
                if packed is None:
                    continue
                epoch_has_data = True
                if starts is not None and item[3] == 0 and not skip:
                    starts.setdefault(yielded, []).append([epoch, *item[:3]])
                if skip:
                    cut = min(skip, len(packed))
                    packed, skip = packed[cut:], skip - cut
                for window in packer.add(packed):
                    out = progress() if starts is None else \
                        dict(progress(), starts=starts.pop(yielded, []))
                    yielded += 1
                    yield torch.from_numpy(window), out
            # (a carried epoch may give this reader nothing; a regular epoch without data would
            # loop on forever without a batch)
            if not epoch_has_data and epoch not in self.carry:
                raise InputError(f"{self.path}: reader {self.rank}.{slot} found no readable data "
                                 f"in split {self.split!r} (all of its samples are bad: see the "
                                 "lines above); repair or rebuild the shards")
            epoch += 1
            if not self.loop:
                break
        reader.close()
        tail = packer.remainder()
        if len(tail):  # the last, smaller batch: keep every full held-out window
            yield torch.from_numpy(tail), progress() if starts is None else \
                dict(progress(), starts=starts.pop(yielded, []))
        elif yielded == 0 and skip_batches == 0:
            warnings.warn(f"{self.path}: reader {self.rank}.{slot} holds fewer than {width} tokens "
                          f"of split {self.split!r}: no batch at all")

    @property
    def group(self) -> int:
        """Batches a worker stacks into one tensor (up to 64, ~1M tokens): a shared-memory tensor
        per batch costs more than reading the batch."""
        return min(64, max(1, 2**20 // (self.batch_size * (self.seq_len + 1)))) \
            if self.num_workers else 1

    def slot_batches(self, consumed: int) -> list[int]:
        """Batches each slot has produced when the rank has consumed `consumed`: group g of G
        batches comes from slot g % slots (the DataLoader's round robin over its workers)."""
        g0, r = divmod(consumed, self.group)
        return [len(range(s, g0, self.slots)) * self.group + (r if g0 % self.slots == s else 0)
                for s in range(self.slots)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        try:
            yield from self._batches()
        except InputError as exc:  # a DataLoader worker's comes with its traceback as the message
            raise InputError(str(exc).rstrip().rsplit("InputError: ", 1)[-1]) from None

    def _batches(self) -> Iterator[torch.Tensor]:
        skips = self.slot_batches(self.consumed)
        if self.num_workers == 0:
            source: Any = self.reader_batches(0, skips[0], self.bad)
        else:
            g0, r = divmod(self.consumed, self.group)
            source = DataLoader(_Readers(self, g0 % self.slots, skips, r), batch_size=None,
                                num_workers=self.num_workers, prefetch_factor=2)
        seen = None
        for batches, progress in source:
            if progress is not seen:  # per batch this loop is the hot path: skip what is unchanged
                seen, slot = progress, progress["slot"]
                self.reader_epochs[slot] = progress["epoch"]
                self.reader_failures[slot] = progress["failures"]
                self.bad.update(map(tuple, progress["bad"]))
                if self.failures > self.max_failures:
                    # InputError: exit 65 and one line; the last checkpoint stays as it was
                    raise InputError(f"{self.path}: {self.failures} bad shards/samples on rank "
                                     f"{self.rank}, more than "
                                     f"data.max_failures={self.max_failures}; see the lines "
                                     "above, then repair or rebuild the shards (or raise "
                                     "data.max_failures)")
            for i, batch in enumerate([batches] if batches.dim() == 2 else batches):
                self.consumed += 1
                self._log_starts(progress, i)
                yield batch

    def _log_starts(self, progress: dict[str, Any], i: int) -> None:
        """SCSE_LOG_SAMPLES: one JSON line per item whose first token is in a consumed batch
        (batch i of a worker's group: workers send a list per batch)."""
        starts = progress.get("starts")
        if not self.log_dir or not starts:
            return
        starts = starts[i] if self.num_workers else starts
        if self._log is None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._log = open(os.path.join(self.log_dir, f"rank{self.rank}-{os.getpid()}.jsonl"),
                             "a")
        reader = self.rank * self.slots + progress["slot"]
        for epoch, s, j, d in starts:
            self._log.write(json.dumps({"reader": reader,
                                        "layout": [self.world_size, self.num_workers],
                                        "epoch": epoch, "item": [s, j, d]}) + "\n")
        self._log.flush()

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: batches consumed in this layout, per reader its epoch and
        batches, and how this layout began (`origin`: None, or the layout change it follows)."""
        batches = self.slot_batches(self.consumed)
        return dict({k: getattr(self, k) for k in STATE_KEYS}, world_size=self.world_size,
                    num_workers=self.num_workers, consumed_batches=self.consumed, epoch=self.epoch,
                    failures=self.reader_failures,
                    readers=[{"reader": self.rank * self.slots + s, "epoch": self.reader_epochs[s],
                              "batches": n} for s, n in enumerate(batches)],
                    bad=sorted(list(b) for b in self.bad), origin=self.origin,
                    tokenizer_sha256=self.index["tokenizer_sha256"])

    def _check(self, state: dict[str, Any], keys: Any = STATE_KEYS) -> None:
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                why = ("the readers' seeded order, and so which samples were read, depends on it. "
                       "Set it back, or start a new run (another name)") if key in ORDER_KEYS else \
                    "one rank's state resumes the same batch shape only: use resume(states)"
                raise ValueError(f"cannot resume data stream: {ORDER_KEYS.get(key, key)} was "
                                 f"{state[key]!r}, now {getattr(self, key)!r}; {why}")
        if state.get("tokenizer_sha256", self.index["tokenizer_sha256"]) != \
                self.index["tokenizer_sha256"]:
            raise ValueError(f"cannot resume data stream: shards at {self.path} were rewritten "
                             f"with another tokenizer ({state['tokenizer_sha256']} -> "
                             f"{self.index['tokenizer_sha256']}); their samples are other ones. "
                             "Start a new run (another name), or restore the shards")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume this rank from its own state, saved at the same layout (see `resume`)."""
        if (state.get("world_size", self.world_size), state.get("num_workers", self.num_workers)) \
                != (self.world_size, self.num_workers):
            raise ValueError(
                f"cannot resume data stream from one rank's state: it was saved with world_size="
                f"{state['world_size']} x data.num_workers={state.get('num_workers', 0)} readers, "
                f"now world_size={self.world_size} x data.num_workers={self.num_workers}; a layout "
                "change needs every rank's state: TokenStream.resume(states)")
        self._check(state)
        self.consumed = int(state["consumed_batches"])
        self.bad = {tuple(b) for b in state.get("bad", [])}
        self.reader_failures = list(state.get("failures", [0] * self.slots))
        self.origin = state.get("origin")
        self.carry = carried_items(self, self.origin) if self.origin else {}
        self.reader_epochs = [r["epoch"] for r in state.get("readers", [])] or \
            [int(state.get("epoch", 0))] * self.slots

    def resume(self, states: list[dict[str, Any]]) -> None:
        """Resume from every rank's state (in rank order): load_state_dict at the same LAYOUT_KEYS,
        else a new layout that first reads the carry of the old one (relayout.py)."""
        first = states[0]
        if all(first.get(k, 0) == getattr(self, k) for k in LAYOUT_KEYS):
            return self.load_state_dict(states[self.rank])
        # positions are token counts, so the micro-batch and seq_len may change here too
        self._check(first, ORDER_KEYS)
        readers = sorted((r["reader"], r["batches"]) for st in states for r in st["readers"])
        bad = sorted({tuple(b) for st in states for b in st.get("bad", [])})
        self.origin = {"world_size": first["world_size"],
                       "num_workers": first.get("num_workers", 0),
                       "tokens": [n * first["batch_size"] * (first["seq_len"] + 1)
                                  for _, n in readers],
                       "bad": [list(b) for b in bad], "origin": first.get("origin")}
        self.bad = set(bad)
        self.carry = carried_items(self, self.origin)
        self.consumed = 0
        self.reader_epochs = [self.start_epoch] * self.slots
        self.reader_failures = [0] * self.slots


class _Readers(IterableDataset):
    """The DataLoader side: worker w plays reader slot (w + rotate) % slots and sends groups of
    `stream.group` batches; the slot whose group a resume cut sends its remainder first."""

    def __init__(self, stream: TokenStream, rotate: int, skips: list[int], cut: int):
        self.stream, self.rotate, self.skips, self.cut = stream, rotate, skips, cut

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        slot = (worker + self.rotate) % self.stream.slots
        batches = self.stream.reader_batches(slot, self.skips[slot], self.stream.bad)
        size = self.stream.group - (self.cut if worker == 0 else 0)
        while chunk := list(islice(batches, size)):
            distinct = {id(p): p for _, p in chunk}.values()  # a progress repeats while unchanged
            progress = dict(chunk[-1][1], bad=[b for p in distinct for b in p["bad"]])
            starts = [p.get("starts", []) for _, p in chunk]  # per batch, when logging
            same = [b for b, _ in chunk if b.shape == chunk[0][0].shape]
            yield torch.stack(same), dict(progress, starts=starts[:len(same)])
            if len(same) < len(chunk):  # a finite stream's smaller last batch
                yield chunk[-1][0], dict(progress, starts=starts[len(same):])
            size = self.stream.group

