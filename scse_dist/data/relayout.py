"""The carry of a layout change: what the old readers left unread of the epochs they were in.

A reader's stream is its items (a sample, or a document of one, from a first token on), epoch
after epoch, each epoch's order a pure function of (seed, epoch, readers R). Its position is a
token count, so what it consumed is a prefix of that stream. At a resume under another layout,
the walk below finds for every old reader where that prefix ends; the rest of that epoch and every
later epoch it had not reached are unread. Per epoch, the carry is the unread items of all old
readers in reader order, permuted with rng(seed, epoch, R_old, R_new); the new readers deal it
round robin (epoch_items), then read regular epochs: every token of an interrupted epoch is read
once across the change.

The carry is never stored: a checkpoint keeps the change as `origin` (the old layout, its readers'
token positions, the bad samples known then, its own origin) and the carry is recomputed from it,
so a later resume at the same layout is bit-exact and a second change walks the first's carry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CARRY_SEED = 0x6361  # "ca": the carry's permutation stream


def carried_items(stream: Any, origin: dict[str, Any], n_new: int = 0) -> dict[int, list]:
    """{epoch: items no old reader consumed} of the layout change `origin` to `n_new` readers."""
    n_new = n_new or stream.n_readers
    n_old = origin["world_size"] * max(1, origin["num_workers"])
    old_carry = carried_items(stream, origin["origin"], n_old) if origin.get("origin") else {}
    probe = stream._new_reader()
    probe.bad = {tuple(b) for b in origin.get("bad", [])}

    def items(reader: int, epoch: int) -> list:
        if epoch in old_carry:
            return old_carry[epoch][reader::n_old]
        return stream.plan(reader, epoch, n_old)

    cuts = []  # per old reader: (epoch it stopped in, its unread items of that epoch)
    for reader, left in enumerate(origin["tokens"]):
        epoch = min(old_carry, default=0)
        while True:
            plan, has_data, rest = items(reader, epoch), False, None
            for i, item in enumerate(plan):
                size = stream._item_size(item, probe)
                has_data |= size > 0
                if left < size or (size == 0 and left == 0):
                    s, j, d, first = item
                    rest = ([(s, j, d, first + left)] if left else [item]) + plan[i + 1:]
                    break
                left -= size
            if rest is not None:
                break
            if not has_data and epoch not in old_carry:
                raise RuntimeError(f"{stream.path}: old reader {reader} has no readable data")
            epoch += 1
        cuts.append((epoch, rest))

    carry: dict[int, list] = {}
    for epoch in range(min(e for e, _ in cuts), max(e for e, _ in cuts) + 1):
        unread = [item for reader, (cut, rest) in enumerate(cuts) if epoch >= cut
                  for item in (rest if epoch == cut else items(reader, epoch))]
        if stream.shuffle:
            rng = np.random.default_rng([stream.seed, epoch, n_old, n_new, CARRY_SEED])
            unread = [unread[i] for i in rng.permutation(len(unread))]
        carry[epoch] = [tuple(int(x) for x in item) for item in unread]
    return carry
