"""The quickstart corpus, real English text with no download: the docstrings of the standard
library's .py files (about 650 modules, 1.8 MB), parsed with `ast`, never imported, walked sorted
(the same corpus, tokenizer and shards on every run of a Python version). The build's marker is
the index.json it writes last: `sources` name this corpus, `tokenizer_sha256` its tokenizer.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import fsspec

from scse_dist.atomic import staged_file
from scse_dist.data.config import DataConfig
from scse_dist.data.index import INDEX_NAME, index_as_written, index_root, join, read_index
from scse_dist.data.shards import is_heldout, write_shards
from scse_dist.data.tokenizer import Tokenizer, train_tokenizer
from scse_dist.typed_yaml import _read_yaml, setting_file

SOURCE = "stdlib_docs:"  # the build's entry in its index's sources (then the stdlib's path)

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of `node` and everything nested in it, in source order."""
    if isinstance(node, DOC_NODES):
        doc = ast.get_docstring(node)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def stdlib_files(root: str | None = None) -> list[str]:
    root = root or sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return files


def stdlib_documents(root: str | None = None) -> Iterator[str]:
    """One document per module, its docstrings joined by blank lines: they share a topic, so the
    model gets long-range context (a docstring alone is often one line)."""
    for path in stdlib_files(root):
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            continue  # a few stdlib files are deliberately invalid (e.g. lib2to3 test data)
        docs = list(_docstrings(tree))
        if docs:
            yield "\n\n".join(docs)


def _exists(url: str) -> bool:
    fs, p = fsspec.core.url_to_fs(url)
    return fs.exists(p)


def _current(path: str) -> bool:
    """Whether the index at `path` reads as this version's shard format."""
    try:
        read_index(path)
    except ValueError:
        return False
    return True


def build_stdlib_corpus(shards: str, tokenizer: str, vocab_size: int, heldout_fraction: float,
                        shard_bytes: int = 2**19) -> dict:
    """Train the tokenizer on the train documents, then write the shards (small: several per
    rank) and put the tokenizer in place, so a failed build leaves nothing."""
    check_build_targets(shards, tokenizer)
    start = time.time()
    docs = list(stdlib_documents())
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print(f"quickstart: {len(docs)} documents ({mb:.1f} MB) of stdlib docstrings "
          f"[{time.time() - start:.1f}s]", flush=True)
    with staged_file(tokenizer) as staged:
        train_tokenizer((d for d in docs if not is_heldout(d, heldout_fraction)), vocab_size,
                        staged)
        tok = Tokenizer.load(staged)
        print(f"quickstart: tokenizer {tokenizer} vocab {tok.vocab_size} "
              f"[{time.time() - start:.1f}s]", flush=True)
        index = write_shards(docs, tok, shards, heldout_fraction=heldout_fraction,
                             shard_bytes=shard_bytes,
                             sources=[SOURCE + sysconfig.get_paths()["stdlib"]])
    elapsed = time.time() - start
    for split, entries in index["splits"].items():
        print(f"quickstart: {split}: {len(entries)} shards, {sum(e['documents'] for e in entries)} "
              f"documents, {sum(e['tokens'] for e in entries):,} tokens")
    tokens = sum(e["tokens"] for es in index["splits"].values() for e in es)
    print(f"quickstart: {len(docs)} documents, {tokens:,} tokens, {mb:.1f} MB, "
          f"{elapsed:.1f}s -> {shards}", flush=True)
    return index


def ensure_data(cfg: DataConfig) -> None:
    """Build `cfg.path`'s shards if needs_build says so. On one process only (data_step): it does
    not lock against concurrent builders."""
    if needs_build(cfg):
        build_stdlib_corpus(cfg.path, cfg.tokenizer, cfg.build_vocab_size, cfg.heldout_fraction)


def data_step(cfg: DataConfig) -> None:
    """A run's data step, after preflight and before train(): ensure_data on rank 0 while the
    other ranks wait, in the process group train() then goes on with."""
    from scse_dist.distributed import abandon, barrier, init_distributed

    try:
        if init_distributed().rank == 0:
            ensure_data(cfg)
        barrier()
    except BaseException:  # one line and its exit status, not gloo's abort at exit
        abandon()
        raise


def needs_build(cfg: DataConfig) -> bool:
    """Whether ensure_data would build `cfg.path` (absent, or written in an older shard format,
    with `cfg.build` set); FileNotFoundError when it is absent and nothing says how to build it."""
    root = index_root(cfg.path)  # data.path may name the index file or a brace pattern of shards
    if _exists(join(root, INDEX_NAME)) and (cfg.build != "stdlib_docs" or _current(root)):
        return False
    if cfg.build == "stdlib_docs":
        return True
    raise FileNotFoundError(
        f"data.path {cfg.path!r} has no {INDEX_NAME}. Build shards with `scse-data shards --input "
        f"<files> --tokenizer {cfg.tokenizer} --out {cfg.path}` (after `scse-data tokenizer`), or "
        "set data.build=stdlib_docs for the quickstart corpus (`scse-data quickstart`).")


def check_build_targets(shards: str, tokenizer: str) -> None:
    """FileExistsError (exit 66) unless `shards` is new, empty or built by this build (its index
    says so), and `tokenizer` new or the one those shards name."""
    root = index_root(shards)
    index = index_as_written(root)  # of any format version; None unless this build wrote it:
    sources = index.get("sources") if index else None
    if not (isinstance(sources, list) and len(sources) == 1 and str(sources[0]).startswith(SOURCE)):
        index = None
    fs, path = fsspec.core.url_to_fs(root)
    if index is None and fs.exists(path) and (not fs.isdir(path) or fs.ls(path, detail=False)):
        raise FileExistsError(
            f"data.path {shards!r} holds files that data.build=stdlib_docs did not write (no "
            f"{INDEX_NAME} of its corpus), and the build writes over nothing it did not make; "
            "check data.path, or give a new folder to build into")
    if _exists(tokenizer):
        with fsspec.open(tokenizer, "rb") as f:
            sha256 = hashlib.sha256(f.read()).hexdigest()
        if index is None or index.get("tokenizer_sha256") != sha256:
            raise FileExistsError(
                f"data.tokenizer {tokenizer!r} exists, and no {INDEX_NAME} of data.build="
                f"stdlib_docs at data.path {shards!r} names it as the tokenizer the build made; "
                "the build writes over nothing it did not make: check data.path and "
                "data.tokenizer, or remove that file to build both again")


def check_build(cfg: DataConfig, config_path: Optional[str], overrides: Sequence[str]) -> None:
    """The build rule (docs/data.md), before anything is written (exit 66): data.build builds only
    into the data.path and data.tokenizer named where it is set (so a mistyped path creates no
    corpus elsewhere), and over nothing it did not make (check_build_targets)."""
    if not needs_build(cfg):
        return
    keys = [item.split("=", 1)[0].strip() for item in overrides]

    def given(name: str) -> bool:  # set by an override of the field or of a section holding it
        return any(name == key or name.startswith(key + ".") for key in keys)

    if config_path is not None and not given("data.build"):
        source = setting_file(Path(config_path), "data.build")
        named = (_read_yaml(source) if source else {}).get("data") or {}
        default = DataConfig()
        moved = [f for f in ("path", "tokenizer")
                 if getattr(cfg, f) != named.get(f, getattr(default, f))]
        if moved:
            def where(field: str) -> str:
                return ("on the command line" if given(f"data.{field}") else
                        f"in {setting_file(Path(config_path), f'data.{field}')}")

            what = (f"data.path {cfg.path!r} ({where('path')}) holds no shards"
                    if "path" in moved else
                    f"data.tokenizer {cfg.tokenizer!r} is set {where('tokenizer')} and data.path "
                    f"{cfg.path!r} holds no shards")
            raise FileNotFoundError(
                f"{what}, and data.build={cfg.build} in {source} builds only into the data.path "
                f"and data.tokenizer that file names; check the path, or set data.build="
                f"{cfg.build} where the path is set to build there")
    check_build_targets(cfg.path, cfg.tokenizer)
