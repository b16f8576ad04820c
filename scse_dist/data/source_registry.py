"""The data sources' registry (docs/architecture.md, "A data source"): a `Source` record each, in
`SOURCES`. An input is read by the first source, highest `priority` first, whose `matches` takes
it. The built-ins register where they are defined: text and JSONL in sources.py, parquet, saved
datasets and Hub streams in columnar.py. A plugin's: an entry point of group PLUGINS naming its
`Source` record, registered on first use (so in `--processes` children too), or `register_source`.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

from scse_dist.data.rows import RowStats


class Unit(NamedTuple):
    """A piece of an input read as one: a file, a parquet row group, rows of a saved dataset."""

    url: str
    kind: str  # its source's name
    rows: range | None = None  # the rows (or row groups) it covers; None: all of it
    weight: int = 1  # bytes, about: what --part balances


class Source(NamedTuple):
    name: str
    matches: Callable[[str], bool]  # an input (expand_inputs' URL) is this source's
    # (url) -> (rows, weight) of its units, in reading order (a --part takes a run of them)
    units: Callable[[str], list[tuple[range | None, int]]]
    # (url, rows or None for all, text_field, text_split, stats) -> its documents, in order
    documents: Callable[[str, range | None, str, str, RowStats], Iterator[str]]
    priority: int = 0  # higher is asked first; the built-ins' are below 0
    files: bool = True  # False: its inputs name no files, expand_inputs passes them on as given
    fields: bool = True  # documents are rows' text_field (what "no documents" names)


SOURCES: dict[str, Source] = {}
PLUGINS = "scse_dist.data_sources"  # an entry-point group: name = "module:SOURCE_RECORD"
_plugins_loaded = False


def register_source(source: Source) -> Source:
    if source.name in SOURCES:
        raise ValueError(f"data source {source.name!r} is registered already")
    SOURCES[source.name] = source
    return source


def by_priority() -> list[Source]:
    """The registered sources in the order they are asked."""
    global _plugins_loaded
    if not _plugins_loaded:
        import importlib.metadata

        _plugins_loaded = True
        for entry in importlib.metadata.entry_points(group=PLUGINS):
            register_source(entry.load())
    return sorted(SOURCES.values(), key=lambda s: -s.priority)


def source_of(url: str) -> Source:
    return next(s for s in by_priority() if s.matches(url))
