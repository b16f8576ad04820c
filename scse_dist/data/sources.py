"""Read documents from text and JSONL files over fsspec (local paths, globs, s3://, ...).

Formats, picked by file name (compression suffixes .gz/.bz2/.xz/.zst are stripped first and
decompressed by fsspec's `compression="infer"`; .zst needs the `zstandard` package):
- `*.jsonl`, `*.json`: one JSON object per line; the document is `obj[text_field]`.
- anything else: plain text. By default a document is a run of lines between blank lines
  (`text_split="blank_lines"`), because plain-text corpora (book dumps) are usually one huge
  file, and one document per file would make the held-out split all-or-nothing.
  `text_split="file"` makes each file one document; `text_split="wikitext"` one WikiText article.
Empty documents are skipped. Inputs are read in the order given, globs expanded sorted.

The evaluation formats have readers of their own, used by scse-eval:
- WikiText (`wiki.{train,valid,test}.raw` or the tokenized `wiki.*.tokens`, -2 and -103 alike):
  an article starts at a top-level heading line ` = Title = ` (sub-headings are ` = = X = = `).
  Each article is returned with its raw text, newlines included, so the word and byte counts of
  all articles add up to those of the file (word perplexity and bits per byte use them).
- LAMBADA: the OpenAI JSONL (`{"text": ...}` per line) or the original plain text (one passage per
  line). The context is the passage minus its last whitespace-separated word, the target is
  `" " + last word`.
Bad input stops with a ValueError naming the file and, where there is one, the line.
"""

from __future__ import annotations

import json
import re
from typing import Iterator, Literal, NamedTuple

import fsspec

COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SPLITS = ("blank_lines", "file", "wikitext")
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


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
                   text_split: Literal["blank_lines", "file", "wikitext"] = "blank_lines"
                   ) -> Iterator[str]:
    """Yield every document of every input (see the module docstring for the formats)."""
    if text_split not in TEXT_SPLITS:
        raise ValueError(f"text_split: must be one of {TEXT_SPLITS}, got {text_split!r}")
    for url in expand_inputs(urls):
        if _is_jsonl(url):
            yield from _iter_jsonl(url, text_field)
        elif text_split == "wikitext":
            yield from read_wikitext_articles(url)
        else:
            yield from _iter_text(url, text_split)


# --------------------------------------------------------------------------- evaluation formats



class Passage(NamedTuple):
    context: str
    target: str  # " " + the last word


def _lines(url: str) -> Iterator[tuple[int, str]]:
    try:
        with fsspec.open(url, "rt", compression="infer", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except UnicodeDecodeError as exc:
        raise ValueError(f"{url}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _single_file(url: str) -> str:
    files = expand_inputs(url)
    if len(files) != 1:
        raise ValueError(f"{url}: expected one file, the pattern matches {len(files)}")
    return files[0]


def read_wikitext_articles(url: str) -> list[str]:
    """The articles of a WikiText file, each as its raw text (heading and newlines included)."""
    url = _single_file(url)
    articles: list[list[str]] = []
    for lineno, line in _lines(url):
        if lineno == 1 and line.lstrip().startswith("{"):
            raise ValueError(f"{url}:1: looks like JSON; WikiText is raw text with ' = Title = ' "
                             "headings (wiki.test.raw)")
        if _WIKITEXT_TITLE.match(line.rstrip("\n")) or not articles:
            articles.append([])
        articles[-1].append(line)
    texts = ["".join(lines) for lines in articles]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"{url}: no text (empty file?)")
    return texts


def _split_passage(text: str, where: str) -> Passage:
    words = text.strip().rsplit(None, 1)
    if len(words) != 2:
        raise ValueError(f"{where}: passage has no context before its last word: {text.strip()[:60]!r}")
    return Passage(words[0], " " + words[1])


def read_lambada(url: str) -> list[Passage]:
    """LAMBADA passages (context, " " + last word) from OpenAI JSONL or one-passage-per-line text."""
    url = _single_file(url)
    jsonl = _is_jsonl(url)
    out = []
    for lineno, line in _lines(url):
        if not line.strip():
            continue
        where = f"{url}:{lineno}"
        text = line
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{where}: expected an object with a string field 'text'")
            text = obj["text"]
        out.append(_split_passage(text, where))
    if not out:
        raise ValueError(f"{url}: no passages (empty file?)")
    return out


def read_corpus(url: str) -> list[str]:
    """Documents of a JSONL (`text` field) or plain-text corpus (blank-line separated), any fsspec URL."""
    docs = list(iter_documents(url))
    if not docs:
        raise ValueError(f"{url}: no documents (empty file?)")
    return docs
