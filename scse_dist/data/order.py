"""Which items each reader of a TokenStream reads in an epoch, and in which order: units (whole
shards if there are as many as readers, else samples, else documents) permuted with
rng(seed, epoch) and dealt round robin, so every token of an epoch is read once; a shard's samples
in rng(seed, epoch, shard) order, then an optional shuffle buffer across a reader's shards. All on
ids before reading (no memory, exact resume).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# (shard, sample, document or -1 for the whole sample, first token)
Item = tuple[int, int, int, int]


def pick_level(n_samples: list[int], n_readers: int) -> str:
    """The unit readers split the data by: "shard", "sample" or "document"."""
    return "shard" if len(n_samples) >= n_readers else \
        "sample" if sum(n_samples) >= n_readers else "document"


def _units(stream: Any, level: str) -> list[tuple[int, int, int]]:
    if level == "shard":
        return [(s, -1, -1) for s in range(len(stream.n_samples))]
    samples = [(s, j) for s, n in enumerate(stream.n_samples) for j in range(n)]
    if level == "sample":
        return [(s, j, -1) for s, j in samples]
    return [(s, j, d) for s, j in samples for d in range(len(stream._doc_lens(s, j)))]


def reader_plan(stream: Any, reader: int, epoch: int, n_readers: int) -> list[Item]:
    """The items `reader` of `n_readers` reads in a regular `epoch` of `stream` (a TokenStream),
    in order: a pure function of ids, seeds and the number of readers."""
    units = _units(stream, pick_level(stream.n_samples, n_readers))
    if stream.shuffle:
        order = np.random.default_rng([stream.seed, epoch]).permutation(len(units))
        units = [units[i] for i in order]
    items: list[Item] = []
    for s, j, d in units[reader::n_readers]:
        if j >= 0:
            items.append((s, j, d, 0))
            continue
        order = np.arange(stream.n_samples[s])
        if stream.shuffle:
            order = np.random.default_rng([stream.seed, epoch, s]).permutation(order)
        items.extend((s, int(k), -1, 0) for k in order)
    if stream.shuffle and stream.shuffle_buffer > 1:
        items = _buffer_shuffle(items, stream.shuffle_buffer,
                                np.random.default_rng([stream.seed, epoch, reader, 1]))
    return items


def _buffer_shuffle(items: list[Item], size: int, rng: np.random.Generator) -> list[Item]:
    """The order a shuffle buffer of `size` emits `items` in: fill, then emit a random slot and
    refill it with the next item; drain in random order at the end."""
    buffer: list[Item] = []
    out: list[Item] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = int(rng.integers(size))
        out.append(buffer[k])
        buffer[k] = item
    rng.shuffle(buffer)
    return out + buffer
