"""Reading shards: index.json checked, a data.path resolved to a split's shards, a shard's
samples. The format and how it is written: shards.py."""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

import fsspec
import numpy as np

from scse_dist.cli_errors import InputError
from scse_dist.data.sample_format import FORMAT, decode_sample

SPLITS = ("train", "heldout")
INDEX_NAME = "index.json"

def join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}"


_REQUIRED = {"format": str, "tokenizer_sha256": str, "vocab_size": int, "eos_id": int,
             "dtype": str, "splits": dict}
_SHARD_FIELDS = {"url": str, "table": str, "tokens": int, "documents": int, "samples": int}


def index_as_written(root: str) -> Optional[dict]:
    """`root`'s index.json as written (any version, unchecked); None if none parses as an object."""
    try:
        with fsspec.open(join(root, INDEX_NAME), "r") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def read_index(path: str) -> dict:
    """Load and check the index.json of `path` (a data.path: see index_root)."""
    url = path if path.endswith(".json") else join(index_root(path), INDEX_NAME)
    try:
        with fsspec.open(url, "r") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no shard index at {url!r} (build shards with `scse-data shards` "
                                "or `scse-data quickstart`)") from None
    except UnicodeDecodeError as exc:  # read, but corrupt: a data error, not a missing input
        raise InputError(f"{url}: not UTF-8 text (byte {exc.object[exc.start]:#04x}): a corrupt "
                         "index; rebuild the shards") from None
    except Exception as exc:  # unreachable endpoint, credentials, unknown protocol
        raise OSError(f"cannot read shard index {url!r}: {type(exc).__name__}: {exc}") from exc
    try:
        index = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{url}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(index, dict):
        raise InputError(f"{url}: expected a JSON object at the top level")
    for field, tp in _REQUIRED.items():
        if not isinstance(index.get(field), tp):
            raise InputError(f"{url}: field {field!r} is missing or not a {tp.__name__}")
    if index["format"] != FORMAT:
        raise InputError(f"{url}: field 'format' is {index['format']!r}, expected {FORMAT!r}: the "
                         "shards were written by another version; rebuild them with `scse-data "
                         "shards` (`scse-data quickstart` for the quickstart corpus)")
    if index["dtype"] not in ("uint16", "uint32"):
        raise InputError(f"{url}: field 'dtype' must be uint16 or uint32, got {index['dtype']!r}")
    for split, shards in index["splits"].items():
        if not isinstance(shards, list):
            raise InputError(f"{url}: field 'splits.{split}' must be a list of shards")
        for i, shard in enumerate(shards):
            for field, tp in _SHARD_FIELDS.items():
                if not isinstance(shard, dict) or field not in shard:
                    raise InputError(f"{url}: field 'splits.{split}[{i}].{field}' is missing")
                if not isinstance(shard[field], tp) or isinstance(shard[field], bool):
                    raise InputError(f"{url}: field 'splits.{split}[{i}].{field}' is not a "
                                     f"{tp.__name__}")
    return index


def check_tokenizer(path: str, index: dict, tokenizer_sha256: str,
                    whose: str = "data.tokenizer") -> None:
    """InputError unless the shards at `path` were written with the tokenizer of sha256
    `tokenizer_sha256` (`whose` names it): another tokenizer's ids are other words."""
    if tokenizer_sha256 != index["tokenizer_sha256"]:
        raise InputError(f"{path.rstrip('/')}/index.json: the shards were written with another "
                         f"tokenizer (sha256 {index['tokenizer_sha256']}, {whose} has "
                         f"{tokenizer_sha256}); read them with the tokenizer they were written "
                         "with, or rebuild them with `scse-data shards`")


def shard_url(path: str, shard: dict) -> str:
    """Absolute URL of a shard entry (index urls are relative to the shard directory)."""
    u = shard["url"]
    return u if "://" in u or u.startswith("/") else join(path, u)


def table_url(path: str, shard: dict) -> str:
    """Absolute URL of a shard entry's sample table."""
    return shard_url(path, {"url": shard["table"]})


def index_root(path: str) -> str:
    """The directory (or URL prefix) holding index.json for a data.path: the path itself, the
    index file's directory, or a brace pattern's directory."""
    if "{" in path.rsplit("/", 1)[-1]:
        path = path.rsplit("/", 1)[0]
    return path[: -len(INDEX_NAME) - 1] if path.endswith("/" + INDEX_NAME) else path.rstrip("/")


def resolve_split(path: str, split: str) -> tuple[str, dict, list[dict], list[str]]:
    """(root, index, entries, urls) of the non-empty shards of `split` under `path`, whose shard
    URLs a brace pattern (`s3://b/web/train-{000000..000127}.tar`) may name, each listed in the
    index (it carries the counts resume relies on)."""
    import braceexpand  # webdataset's own dependency

    pattern = path if "{" in path.rsplit("/", 1)[-1] else None
    root = index_root(path)
    index = read_index(root)
    if split not in index["splits"]:
        raise InputError(f"{root}: no split {split!r} (has {sorted(index['splits'])})")
    entries = [e for e in index["splits"][split] if e["tokens"] > 0]
    if pattern is not None:
        listed = {shard_url(root, e) for es in index["splits"].values() for e in es}
        wanted = list(braceexpand.braceexpand(pattern))
        unknown = [u for u in wanted if u not in listed]
        if unknown:
            raise FileNotFoundError(f"{pattern}: {len(unknown)} shard(s) not listed in "
                                    f"{join(root, INDEX_NAME)}, e.g. {unknown[0]}")
        by_url = {shard_url(root, e): e for e in index["splits"][split]}
        # a split the pattern names no shard of (the held-out one beside training's) is read whole
        if any(u in by_url for u in wanted):
            entries = [by_url[u] for u in wanted if u in by_url and by_url[u]["tokens"] > 0]
    urls = [shard_url(root, e) for e in entries]
    check_shards_exist(urls + [table_url(root, e) for e in entries])
    return root, index, entries, urls


def check_shards_exist(urls: list[str]) -> None:
    """Fail at start-up, naming the files, when shards (or tables) are missing or storage is
    unreachable: one listing per directory, cheap on object storage."""
    listed: dict[str, set[str]] = {}
    missing = []
    for url in urls:
        parent = url.rsplit("/", 1)[0]
        if parent not in listed:
            fs, dir_path = fsspec.core.url_to_fs(parent)
            try:
                listed[parent] = {p.rstrip("/").rsplit("/", 1)[-1]
                                  for p in fs.ls(dir_path, detail=False)}
            except FileNotFoundError:
                listed[parent] = set()
            except Exception as exc:  # network, permissions, bad endpoint: say which URL
                raise OSError(f"cannot list shard directory {parent!r}: "
                              f"{type(exc).__name__}: {exc}") from exc
        if url.rsplit("/", 1)[-1] not in listed[parent]:
            missing.append(url)
    if missing:
        raise FileNotFoundError(f"{len(missing)} shard(s) named in the index are missing, e.g. "
                                f"{missing[0]!r} (rebuild with `scse-data shards`, or check the "
                                "URL)")


def iter_samples(url: str, eos: int, vocab_size: int
                 ) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield (key, tokens, doc_lens) for every sample of one tar shard, in file order; tokens
    hold each document followed by eos. ValueError naming the shard and sample on bad data."""
    with fsspec.open(url, "rb") as f:
        for parts in tar_samples(f, url):
            yield parts["__key__"], *decode_sample(parts, f"{url}: sample {parts['__key__']!r}",
                                                   eos, vocab_size)


def tar_samples(f: Any, url: str) -> Iterator[dict[str, Any]]:
    """The samples of an open tar shard in file order: {"__key__": key, member: bytes}."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator  # imports torch

    return group_by_keys({**d, "__url__": url} for d in tar_file_iterator(f))
