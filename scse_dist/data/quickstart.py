"""The quickstart corpus: real English text on every machine, with no download.

Source: the docstrings of the Python standard library's own .py files (about 650 modules,
1.8 MB of prose with code samples). Files are parsed with `ast`, never imported (imports run
code). Test suites, site-packages and __pycache__ are skipped. Paths are walked sorted, so the
corpus, the tokenizer and the shards are identical on every run of the same Python version.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import time
from typing import Iterator, Optional, Sequence

import fsspec

from scse_dist.config import DataConfig
from scse_dist.data.shards import INDEX_NAME, index_root, is_heldout, join, read_index, write_shards
from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

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
    """One document per module: all its docstrings joined by blank lines.

    A module is the natural document: its docstrings share one topic and vocabulary, so packing
    them together gives the model real long-range context; a docstring alone is often one line.
    """
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
    """Train the tokenizer on the stdlib docstrings and write the shards; print a summary.

    The tokenizer sees only the train documents. Small shards (512 KiB) by default so the
    quickstart exercises the multi-shard rank split.
    """
    start = time.time()
    docs = list(stdlib_documents())
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print(f"quickstart: {len(docs)} documents ({mb:.1f} MB) of stdlib docstrings "
          f"[{time.time() - start:.1f}s]", flush=True)
    train_tokenizer((d for d in docs if not is_heldout(d, heldout_fraction)), vocab_size, tokenizer)
    tok = Tokenizer.load(tokenizer)
    print(f"quickstart: tokenizer {tokenizer} vocab {tok.vocab_size} [{time.time() - start:.1f}s]",
          flush=True)
    index = write_shards(docs, tok, shards, heldout_fraction=heldout_fraction,
                         shard_bytes=shard_bytes,
                         sources=["stdlib_docs:" + sysconfig.get_paths()["stdlib"]])
    elapsed = time.time() - start
    for split, entries in index["splits"].items():
        print(f"quickstart: {split}: {len(entries)} shards, {sum(e['documents'] for e in entries)} "
              f"documents, {sum(e['tokens'] for e in entries):,} tokens")
    tokens = sum(e["tokens"] for es in index["splits"].values() for e in es)
    print(f"quickstart: {len(docs)} documents, {tokens:,} tokens, {mb:.1f} MB, "
          f"{elapsed:.1f}s -> {shards}", flush=True)
    return index


def ensure_data(cfg: DataConfig) -> None:
    """Make sure `cfg.path` holds shards: return if it does, build them if `cfg.build` says how.

    Call it on one process (rank 0) and barrier: it does not lock against concurrent builders.
    """
    if needs_build(cfg):
        build_stdlib_corpus(cfg.path, cfg.tokenizer, cfg.build_vocab_size, cfg.heldout_fraction)


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


def check_build_asked(cfg: DataConfig, config_path: Optional[str], overrides: Sequence[str]
                      ) -> None:
    """The build rule: `data.build` writes only into the data.path and data.tokenizer named where
    data.build itself is set. A build set in the config file, with data.path or data.tokenizer
    moved on the command line, is refused (FileNotFoundError, exit 66) when it would build: a
    mistyped path must not create a corpus somewhere else and overwrite the file's tokenizer.
    Giving data.build on the command line too asks for the build there."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]

    def given(name: str) -> bool:  # set by an override of the field or of a section holding it
        return any(name == key or name.startswith(key + ".") for key in keys)

    moved = [name for name in ("data.path", "data.tokenizer") if given(name)]
    if not moved or given("data.build") or not needs_build(cfg):
        return
    what = (f"data.path {cfg.path!r} (on the command line) holds no shards" if "data.path" in moved
            else f"data.tokenizer {cfg.tokenizer!r} is on the command line and data.path "
                 f"{cfg.path!r} holds no shards")
    raise FileNotFoundError(
        f"{what}, and data.build={cfg.build} in {config_path} builds only into the data.path and "
        f"data.tokenizer that file names; check the path, or add data.build={cfg.build} to the "
        "command line to build there")
