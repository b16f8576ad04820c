"""Documents from text and JSONL files over fsspec (local paths, globs, s3://, ...; docs/data.md),
by name after a compression suffix (.gz/.bz2/.xz/.zst, decompressed by fsspec): `*.jsonl`/`*.json`
one JSON object per line, `obj[text_field]`; else plain text, a document per run of lines between
blank lines (a book dump as one document would make the held-out split all or nothing), per file
or per WikiText article (`text_split`); parquet, directories and `hf:` specs: columnar.py. Each
format is a registered `Source` (source_registry.py), the first that matches an input reads it. Bad
input is an InputError naming file and line, a missing one FileNotFoundError, an unreadable OSError.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import lzma
import re
import zlib
from typing import Any, Iterator, Literal

from scse_dist.cli_errors import InputError
from scse_dist.data.columnar import directory_files
from scse_dist.data.rows import RowStats
from scse_dist.data.source_registry import (
    SOURCES,
    Source,
    Unit,
    by_priority,
    register_source,
    source_of,
)
from scse_dist.typed_yaml import ConfigError

COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SPLITS = ("blank_lines", "file", "wikitext")
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


def expand_inputs(urls: list[str] | tuple[str, ...] | str) -> list[str]:
    """URLs or globs -> the concrete file URLs, in argument order, each glob sorted. A directory
    becomes its parquet files (sorted) or stays itself when it is a saved dataset; an input of a
    source that reads no files (an `hf:` spec: scse_dist.data.columnar) stays as it is."""
    urls = [urls] if isinstance(urls, str) else urls
    import fsspec  # here, not at the top: commands that only parse their arguments skip it

    out: list[str] = []
    for url in urls:
        if any(s.matches(url) for s in by_priority() if not s.files):  # a malformed one fails here
            out.append(url)
            continue
        local = "://" not in url or url.startswith("file://")
        try:
            files = fsspec.open_files(url)  # expands globs; keeps a literal path as-is
            # local files by their path: messages then name the file as the user knows it
            found = sorted(f.path if local else f.full_name for f in files)
            missing = not found or not all(files.fs.exists(f.path) for f in files)
            inside = directory_files(files.fs, files[0].path, url) if len(files) == 1 and \
                not missing else None
        except (ConfigError, IsADirectoryError):
            raise
        except Exception as exc:  # only fsspec runs here: unknown protocol, no backend, network
            raise OSError(f"input {url!r} cannot be listed: {type(exc).__name__}: {exc}") from exc
        if missing:
            raise FileNotFoundError(f"input {url!r} matches no file" +
                                    ("" if local else " (or its server cannot be reached)"))
        if inside is not None:
            found = [files.fs.unstrip_protocol(p) if not local else p for p in inside]
        protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
        out.extend(n if "://" in n or not protocol else protocol + n for n in found)
    return out


def is_jsonl(url: str) -> bool:
    name = url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.endswith(JSONL_SUFFIXES)


def text_lines(url: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, any fsspec URL, decompressed by its suffix; decoded
    line by line, so a byte that is not UTF-8 is reported at its line; "\r\n" becomes "\n"."""
    import fsspec

    try:
        f = fsspec.open(url, "rb", compression="infer").open()
    except FileNotFoundError:
        raise FileNotFoundError(f"input {url!r} does not exist") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"input {url!r} is a directory, not a text or JSONL file (a shard "
                                "directory holds index.json)") from None
    except Exception as exc:  # only fsspec runs here: unknown protocol, missing backend, network
        raise OSError(f"input {url!r} cannot be opened: {type(exc).__name__}: {exc}") from exc
    lineno = 0
    with f:
        try:
            # buffered here: zstd's stream reader cannot readline itself
            for lineno, raw in enumerate(io.BufferedReader(f, 1 << 20), 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"{url}:{lineno}: not UTF-8 text (byte "
                                     f"{raw[exc.start]:#04x} at column {exc.start + 1}); convert "
                                     "the file to UTF-8") from None
                yield lineno, line[:-2] + "\n" if line.endswith("\r\n") else line
        except (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile) as exc:
            raise InputError(f"{url}:{lineno + 1}: corrupt or truncated compressed data "
                             f"({type(exc).__name__}: {exc}); check the file and its "
                             "suffix") from None


def jsonl_values(url: str) -> Iterator[tuple[str, Any]]:
    """("file:line", value) of every non-blank line of a JSONL file: the one JSONL parser (the
    training inputs and the evaluation tasks' files read through it)."""
    for lineno, line in text_lines(url):
        if not line.strip():
            continue
        try:
            yield f"{url}:{lineno}", json.loads(line)
        except json.JSONDecodeError as exc:
            # some of json's messages end in "at" ("Invalid control character at")
            raise InputError(f"{url}:{lineno}: not valid JSON ({exc.msg.removesuffix(' at')} "
                             f"at column {exc.colno})") from None


def _iter_jsonl(url: str, text_field: str, stats: RowStats) -> Iterator[str]:
    for where, obj in jsonl_values(url):
        has = isinstance(obj, dict) and text_field in obj
        missing = None if has else \
            f"set --text-field; keys: {list(obj)[:8] if isinstance(obj, dict) else '-'}"
        text = stats.take(obj[text_field] if has else None, where, text_field, missing)
        if text is not None:
            yield text


def _iter_text(url: str, text_split: str) -> Iterator[str]:
    if text_split == "file":
        text = "".join(line for _, line in text_lines(url))
        if text.strip():
            yield text
        return
    lines = (line for _, line in text_lines(url))
    for nonblank, run in itertools.groupby(lines, key=lambda line: bool(line.strip())):
        if nonblank:
            yield "".join(run).rstrip("\n")


def _file_units(url: str) -> list[tuple[range | None, int]]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return [(None, max(int(fs.size(path) or 1), 1))]


def _text_documents(url: str, rows: range | None, text_field: str, text_split: str,
                    stats: RowStats) -> Iterator[str]:
    return iter(read_wikitext_articles(url)) if text_split == "wikitext" else \
        _iter_text(url, text_split)


register_source(Source("jsonl", is_jsonl, _file_units,
                       lambda url, rows, field, split, stats: _iter_jsonl(url, field, stats),
                       priority=-30))
register_source(Source("text", lambda url: True, _file_units, _text_documents, priority=-50,
                       fields=False))


def list_units(files: list[str]) -> list[Unit]:
    """The units of expanded inputs, in reading order, each weighed (for --part)."""
    return [Unit(url, s.name, rows, weight) for url in files for s in [source_of(url)]
            for rows, weight in s.units(url)]


def partition(units: list[Unit], part: int, parts: int) -> list[Unit]:
    """Part `part` of `parts` (from 0): a contiguous run of units, the runs balanced by weight,
    so the parts read in order are the whole input in order."""
    total = sum(u.weight for u in units) or 1
    mine, before = [], 0
    for u in units:
        if min(parts - 1, (2 * before + u.weight) * parts // (2 * total)) == part:
            mine.append(u)
        before += u.weight
    return mine


def iter_documents(urls: list[str] | tuple[str, ...] | str, text_field: str = "text",
                   text_split: Literal["blank_lines", "file", "wikitext"] = "blank_lines",
                   stats: RowStats | None = None, part: tuple[int, int] | None = None
                   ) -> Iterator[str]:
    """Yield every document of every input (formats: the module docstring). `stats`: the rows
    skipped and the bad-row limit (default 0). `part=(k, n)`: part k of n (`partition`), so parts
    0..n-1 in turn yield what part=None does. Inputs without a document are an InputError (a job
    would train on nothing); a part may be empty."""
    if text_split not in TEXT_SPLITS:
        raise ConfigError(f"text_split: must be one of {TEXT_SPLITS}, got {text_split!r}")
    stats = stats if stats is not None else RowStats()
    files = expand_inputs(urls)
    units = [Unit(url, source_of(url).name) for url in files] if part is None else \
        partition(list_units(files), *part)
    n = 0
    for u in units:
        for doc in SOURCES[u.kind].documents(u.url, u.rows, text_field, text_split, stats):
            n += 1
            yield doc
    if n == 0 and part is None:
        names = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        rows = all(source_of(f).fields for f in files)
        what = f"no row with a non-empty {text_field!r}" if rows else "nothing but blank lines"
        raise InputError(f"{names}: no documents ({what}; empty input?)")




def single_file(url: str) -> str:
    files = expand_inputs(url)
    if len(files) != 1:
        raise InputError(f"{url}: expected one file, the pattern matches {len(files)}")
    return files[0]


def read_wikitext_articles(url: str) -> list[str]:
    """The articles of a WikiText file (raw or tokenized, -2 or -103), each its raw text from its
    ` = Title = ` line on, newlines included: their word and byte counts add up to the file's
    (the wikitext task's word perplexity and bits per byte)."""
    url = single_file(url)
    articles: list[list[str]] = []
    for lineno, line in text_lines(url):
        if lineno == 1 and line.lstrip().startswith("{"):
            raise InputError(f"{url}:1: looks like JSON; WikiText is raw text with ' = Title = ' "
                             "headings (wiki.test.raw)")
        if _WIKITEXT_TITLE.match(line.rstrip("\n")) or not articles:
            articles.append([])
        articles[-1].append(line)
    texts = ["".join(lines) for lines in articles]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"{url}: no text (empty file?)")
    return texts


def read_corpus(url: str) -> list[str]:
    """Documents of a JSONL (`text` field) or plain-text corpus (iter_documents' defaults)."""
    return list(iter_documents(url))
