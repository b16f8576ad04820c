"""Read documents from text and JSONL files over fsspec (local paths, globs, s3://, ...).

Formats, picked by file name (compression suffixes .gz/.bz2/.xz/.zst are stripped first and
decompressed by fsspec's `compression="infer"`; .zst needs the `zstandard` package):
- `*.jsonl`, `*.json`: one JSON object per line; the document is `obj[text_field]`.
- anything else: plain text. By default a document is a run of lines between blank lines
  (`text_split="blank_lines"`), because plain-text corpora (WikiText, book dumps) are usually
  one huge file, and one document per file would make the held-out split all-or-nothing.
  `text_split="file"` makes each file one document instead.
Empty documents are skipped. Inputs are read in the order given, globs expanded sorted.
"""

from __future__ import annotations

import json
from typing import Iterator, Literal

import fsspec

COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def expand_inputs(urls: list[str] | tuple[str, ...] | str) -> list[str]:
    """URLs or globs -> the concrete file URLs, in argument order, each glob sorted."""
    if isinstance(urls, str):
        urls = [urls]
    out: list[str] = []
    for url in urls:
        files = fsspec.open_files(url)  # expands globs; keeps a literal path as-is
        found = sorted(f.full_name for f in files)
        fs = files.fs if len(files) else None
        if not found or (fs is not None and not all(fs.exists(f.path) for f in files)):
            raise FileNotFoundError(f"input {url!r} matches no file")
        protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
        out.extend(n if "://" in n or not protocol else protocol + n for n in found)
    return out


def _is_jsonl(url: str) -> bool:
    name = url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name.endswith(JSONL_SUFFIXES)


def _iter_jsonl(url: str, text_field: str) -> Iterator[str]:
    with fsspec.open(url, "rt", compression="infer", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{url}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise ValueError(f"{url}:{lineno}: no field {text_field!r} "
                                 f"(set text_field; keys: {list(obj)[:8] if isinstance(obj, dict) else '-'})")
            text = obj[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{url}:{lineno}: field {text_field!r} is {type(text).__name__}, "
                                 "expected a string")
            if text.strip():
                yield text


def _iter_text(url: str, text_split: str) -> Iterator[str]:
    with fsspec.open(url, "rt", compression="infer", encoding="utf-8") as f:
        if text_split == "file":
            text = f.read()
            if text.strip():
                yield text
            return
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
        if lines:
            yield "".join(lines).rstrip("\n")


def iter_documents(urls: list[str] | tuple[str, ...] | str, text_field: str = "text",
                   text_split: Literal["blank_lines", "file"] = "blank_lines") -> Iterator[str]:
    """Yield every document of every input (see the module docstring for the formats)."""
    if text_split not in ("blank_lines", "file"):
        raise ValueError(f"text_split: must be 'blank_lines' or 'file', got {text_split!r}")
    for url in expand_inputs(urls):
        if _is_jsonl(url):
            yield from _iter_jsonl(url, text_field)
        else:
            yield from _iter_text(url, text_split)
