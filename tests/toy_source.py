"""A toy data source of a user's own, added the way docs/architecture.md says ("A data source"):
this module's `Source` record, registered by `register_source` or by a plugin's entry point, and
no file of the package touched. `toy://N` reads N generated documents, UNIT of them a unit (what
`--part` splits at)."""

from __future__ import annotations

import re
from typing import Iterator

from scse_dist.data.rows import RowStats
from scse_dist.data.source_registry import Source

UNIT = 8
WORDS = "the cat sees a red ball my sister paints the blue river while small birds read".split()


def document(i: int) -> str:
    return f"Toy {i}. " + " ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(4 + i % 9))


def _count(url: str) -> int:
    return int(url.removeprefix("toy://"))


def toy_units(url: str) -> list[tuple[range | None, int]]:
    """One unit per UNIT documents, weighed by their characters."""
    n = _count(url)
    units = [range(a, min(a + UNIT, n)) for a in range(0, n, UNIT)]
    return [(rows, sum(len(document(i)) for i in rows)) for rows in units]


def toy_documents(url: str, rows: range | None, text_field: str, text_split: str,
                  stats: RowStats) -> Iterator[str]:
    for i in rows if rows is not None else range(_count(url)):
        yield document(i)


TOY = Source("toy", lambda url: re.fullmatch(r"toy://\d+", url) is not None, toy_units,
             toy_documents, files=False, fields=False)
