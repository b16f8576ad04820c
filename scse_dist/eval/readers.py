"""Evaluation inputs over fsspec: WikiText articles, LAMBADA passages, and plain corpora.

- WikiText (`wiki.{train,valid,test}.raw` or the tokenized `wiki.*.tokens`, -2 and -103 alike):
  an article starts at a top-level heading line ` = Title = ` (sub-headings are ` = = X = = `).
  Each article is returned with its raw text, newlines included, so the word and byte counts of
  all articles add up to those of the file (word perplexity and bits per byte use them).
- LAMBADA: the OpenAI JSONL (`{"text": ...}` per line) or the original plain text (one passage per
  line). The context is the passage minus its last whitespace-separated word, the target is
  `" " + last word`.
Bad input stops with a ValueError naming the file and, where there is one, the line.

These are minimal readers for evaluation; the data pipeline's readers (scse_dist.data.sources)
serve the training corpora.
"""

from __future__ import annotations

import json
import re
from typing import Iterator, NamedTuple

import fsspec

from scse_dist.data.sources import _is_jsonl, expand_inputs

_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")


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
    from scse_dist.data.sources import iter_documents

    docs = list(iter_documents(url))
    if not docs:
        raise ValueError(f"{url}: no documents (empty file?)")
    return docs
