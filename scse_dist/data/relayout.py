"""The carry of a layout change: what the old readers left unread of the epochs they were in.

A reader's position is a token count into its items (a sample, or a document, from a first token
on), epoch after epoch in an order that is a pure function of (seed, epoch, readers), so what it
read is a prefix. For each old reader the walk below finds where that prefix ends; per epoch, the
carry is the unread items of all old readers in reader order, permuted with rng(seed, epoch,
R_old, R_new), which the new readers deal round robin (epoch_items) before their regular epochs.
The carry is never stored: it is recomputed from a checkpoint's `origin` (the old layout, its
token positions, the bad samples, its own origin), so a second change walks the first's carry.
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
