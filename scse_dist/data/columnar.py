"""Columnar inputs of `scse-data` (docs/data.md, "Inputs"), the document being each row's
`text_field` column: `*.parquet` files (pyarrow, row group by row group), a `save_to_disk`
directory and an `hf:NAME[:CONFIG]:SPLIT` Hub stream (`datasets`). Rows go through RowStats,
named `URL: row N` (from 0). A unit for `--part` is a parquet row group, ROWS_PER_UNIT rows of a
saved dataset, or a whole Hub stream (it cannot be split unread). Each registers its `Source`.
"""

from __future__ import annotations

import functools
import itertools
import posixpath
from typing import Any, Iterator

from scse_dist.data.extras import require_extra
from scse_dist.data.rows import RowStats
from scse_dist.data.source_registry import Source, register_source
from scse_dist.typed_yaml import ConfigError

HF_PREFIX = "hf:"
PARQUET_SUFFIX = ".parquet"
ROWS_PER_UNIT = 8192  # a saved dataset's rows per unit: parts balance to within one of them
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")


def is_parquet(url: str) -> bool:
    return url.lower().endswith(PARQUET_SUFFIX)


def parse_hf(spec: str) -> tuple[str, str | None, str]:
    """'hf:NAME[:CONFIG]:SPLIT' -> (NAME, CONFIG or None, SPLIT)."""
    parts = spec[len(HF_PREFIX):].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(f"input {spec!r}: a Hub dataset is hf:NAME:SPLIT or "
                          "hf:NAME:CONFIG:SPLIT (e.g. hf:wikitext:wikitext-103-raw-v1:train)")
    return parts[0], parts[1] if len(parts) == 3 else None, parts[-1]


def directory_files(fs: Any, path: str, url: str) -> list[str] | None:
    """What a directory input stands for: [path] for a saved dataset, its parquet files (sorted)
    otherwise; None when `path` is not a directory."""
    if not fs.isdir(path):
        return None
    if all(fs.exists(posixpath.join(path, name)) for name in SAVED_DATASET_FILES):
        return [path]
    if fs.exists(posixpath.join(path, "dataset_dict.json")):
        splits = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)
                        if fs.isdir(p))
        raise ConfigError(f"input {url!r} is a datasets DatasetDict (splits {splits}); give one "
                          f"split's directory, e.g. {url.rstrip('/')}/{(splits or ['train'])[0]}")
    files = sorted(p for p in fs.find(path) if is_parquet(p))
    if not files:
        raise IsADirectoryError(f"input {url!r} is a directory, not a text or JSONL file (a "
                                "shard directory holds index.json), and holds no .parquet file "
                                "nor a datasets save_to_disk dataset")
    return files


def _open_parquet(url: str) -> Any:
    import fsspec

    pq = require_extra("pyarrow.parquet", "parquet", "reading this input")
    try:
        return pq.ParquetFile(fsspec.open(url, "rb").open())
    except FileNotFoundError:
        raise FileNotFoundError(f"input {url!r} does not exist") from None
    except Exception as exc:  # pyarrow's ArrowInvalid for a file that is not parquet, or fsspec's
        from scse_dist.cli_errors import InputError

        if type(exc).__name__ == "ArrowInvalid":
            raise InputError(f"{url}: not a parquet file ({exc})") from None
        raise OSError(f"input {url!r} cannot be opened: {type(exc).__name__}: {exc}") from exc


def parquet_units(url: str) -> list[tuple[range | None, int]]:
    """(row group, its compressed bytes) of a parquet file's units, in file order."""
    meta = _open_parquet(url).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return [(range(i, i + 1), max(sum(g.column(c).total_compressed_size
                                      for c in range(g.num_columns)), 1))
            for i, g in enumerate(groups)]


def iter_parquet(url: str, groups: range | None, text_field: str, stats: RowStats
                 ) -> Iterator[str]:
    """Documents of a parquet file's row groups `groups` (all when None)."""
    pf = _open_parquet(url)
    meta = pf.metadata
    names = pf.schema_arrow.names
    missing = None if text_field in names else f"set --text-field; columns: {names[:8]}"
    first_row = [0, *itertools.accumulate(meta.row_group(i).num_rows
                                          for i in range(meta.num_row_groups))]
    for g in groups if groups is not None else range(meta.num_row_groups):
        rows = range(first_row[g], first_row[g + 1])
        values = [None] * len(rows) if missing else \
            pf.read_row_group(g, columns=[text_field]).column(0).to_pylist()
        yield from filter(None, (stats.take(v, f"{url}: row {r}", text_field, missing)
                                 for r, v in zip(rows, values)))


@functools.lru_cache(maxsize=8)
def _load_saved(path: str) -> Any:
    datasets = require_extra("datasets", "hf-datasets", "reading this input")
    return datasets.load_from_disk(path)


def saved_units(path: str) -> list[tuple[range | None, int]]:
    """(rows, weight) of a saved dataset's units: ROWS_PER_UNIT rows each, 256 bytes a row."""
    n = len(_load_saved(path))
    units = [range(a, min(a + ROWS_PER_UNIT, n)) for a in range(0, n, ROWS_PER_UNIT)]
    return [(rows, 256 * len(rows)) for rows in units]


def iter_saved(path: str, rows: range | None, text_field: str, stats: RowStats) -> Iterator[str]:
    """Documents of a saved dataset's rows `rows` (all when None), in order."""
    ds = _load_saved(path)
    rows = rows if rows is not None else range(len(ds))
    columns = ds.column_names
    missing = None if text_field in columns else f"set --text-field; columns: {columns[:8]}"
    for start in range(rows.start, rows.stop, ROWS_PER_UNIT):
        stop = min(start + ROWS_PER_UNIT, rows.stop)
        values = [None] * (stop - start) if missing else ds[start:stop][text_field]
        yield from filter(None, (stats.take(v, f"{path}: row {r}", text_field, missing)
                                 for r, v in enumerate(values, start)))


def iter_hub(spec: str, text_field: str, stats: RowStats) -> Iterator[str]:
    """Documents of a Hub dataset, streamed in the dataset's order."""
    name, config, split = parse_hf(spec)
    datasets = require_extra("datasets", "hf-datasets", "reading this input")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        rows = iter(ds)
    except Exception as exc:  # no network, an unknown name, config or split: one line
        raise OSError(f"input {spec!r} cannot be loaded: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    for r, row in enumerate(rows):
        missing = None if text_field in row else f"set --text-field; columns: {list(row)[:8]}"
        text = stats.take(row.get(text_field), f"{spec}: row {r}", text_field, missing)
        if text is not None:
            yield text


def _is_saved(url: str) -> bool:  # a directory left by expand_inputs is a saved dataset
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs.isdir(path)


register_source(Source("hub", lambda url: url.startswith(HF_PREFIX) and bool(parse_hf(url)),
                       lambda url: [(None, 2**30)],  # nominal: a stream has no known size
                       lambda url, rows, field, split, stats: iter_hub(url, field, stats),
                       priority=-10, files=False))
register_source(Source("parquet", is_parquet, parquet_units,
                       lambda url, rows, field, split, stats: iter_parquet(url, rows, field, stats),
                       priority=-20))
register_source(Source("saved", _is_saved, saved_units,
                       lambda url, rows, field, split, stats: iter_saved(url, rows, field, stats),
                       priority=-40))
