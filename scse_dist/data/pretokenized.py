"""`scse-data import`: token ids already made (llm.c / modded-nanogpt `.bin`, a 1-D `.npy`, raw
little-endian uint16 or uint32) into shards (docs/data.md, "Pre-tokenized corpora"). The files
are one token stream in the order given; the tokenizer's eos separates documents (a document cut
at a file's end goes on in the next file, as llm.c writes them). Each file is memory-mapped and
checked in chunks, vectorised (header, ids within the vocabulary, at least one eos) before
anything is written; then the documents go through the shard writer, held out by the hash of
their decoded text as `scse-data shards` holds out the same text.
"""

from __future__ import annotations

import glob
import os
from typing import Iterator, NamedTuple

import fsspec
import numpy as np

from scse_dist.cli_errors import InputError, one_line
from scse_dist.data.shards import (
    check_layout,
    finish_index,
    is_heldout,
    no_documents,
    shard_meta,
    shards_output,
    split_writers,
)
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.typed_yaml import ConfigError

# llm.c's dev/data/data_common.py: a header of 256 little-endian int32 (magic, version, token
# count, then zeros), then the ids; (magic, version) -> the ids' dtype
BIN_HEADER_BYTES = 256 * 4
BIN_KINDS: dict[tuple[int, int], np.dtype] = {
    (20240520, 1): np.dtype("<u2"),  # GPT-2 ids (modded-nanogpt's too)
    (20240801, 7): np.dtype("<u4"),  # Llama 3 ids
}
RAW_DTYPES: dict[str, np.dtype] = {"raw-uint16": np.dtype("<u2"), "raw-uint32": np.dtype("<u4")}
CHUNK_TOKENS = 1 << 24  # the check reads this many ids at a time


class TokenFile(NamedTuple):
    path: str
    ids: np.ndarray  # 1-D, memory-mapped
    offset: int  # the byte offset of ids[0] in the file
    eos: np.ndarray  # int64: the positions of the eos in ids, ascending


def _memmap(path: str, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map nothing
        return np.zeros(0, dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,)))


def _bin_ids(path: str, size: int) -> tuple[np.ndarray, int]:
    if size < BIN_HEADER_BYTES:
        raise InputError(f"{path}: byte {size}: the file ends inside the {BIN_HEADER_BYTES}-byte "
                         "llm.c header (magic, version, token count)")
    magic, version, count = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    known = sorted({m for m, _ in BIN_KINDS})
    if magic not in known:
        raise InputError(f"{path}: byte 0: magic {magic}, expected one of {known} (llm.c's GPT-2 "
                         "or Llama 3 ids): not an llm.c .bin token file")
    dtype = BIN_KINDS.get((magic, version))
    if dtype is None:
        raise InputError(f"{path}: byte 4: version {version} with magic {magic}, expected "
                         f"{[v for m, v in BIN_KINDS if m == magic][0]}")
    end = BIN_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or end != size:
        said = "past the file's end" if end > size else f"{size - end:,} bytes short of its end"
        raise InputError(f"{path}: byte 8: the header counts {count:,} {dtype.name} ids, which "
                         f"end at byte {end:,}, {said} (byte {size:,})")
    return _memmap(path, dtype, BIN_HEADER_BYTES, count), BIN_HEADER_BYTES


def _npy_ids(path: str) -> tuple[np.ndarray, int]:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InputError(f"{path}: byte 0: not a .npy array file ({one_line(exc)})") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputError(f"{path}: byte 0: a {arr.dtype} array of shape {arr.shape}; expected 1-D "
                         "integer token ids")
    return np.asarray(arr), int(getattr(arr, "offset", 0))


def _raw_ids(path: str, size: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    left = size % dtype.itemsize
    if left:
        raise InputError(f"{path}: byte {size - left:,}: {left} byte(s) left over, not a whole "
                         f"{dtype.name} id: not raw {dtype.name} ids")
    return _memmap(path, dtype, 0, size // dtype.itemsize), 0


def open_ids(path: str, fmt: str) -> tuple[np.ndarray, int]:
    """(the ids of `path` as a 1-D memory map, the byte offset of the first); InputError naming
    the file and byte where the file is not of format `fmt`."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: a directory, not a token file")
    size = os.path.getsize(path)  # FileNotFoundError: exit 66
    if fmt == "llm-c-bin":
        return _bin_ids(path, size)
    if fmt == "npy":
        return _npy_ids(path)
    if fmt in RAW_DTYPES:
        return _raw_ids(path, size, RAW_DTYPES[fmt])
    raise ConfigError(f"--format {fmt!r}: expected llm-c-bin, npy, {', '.join(RAW_DTYPES)}")


def check_ids(path: str, ids: np.ndarray, offset: int, tokenizer: Tokenizer) -> np.ndarray:
    """The positions of the eos in `ids`, found a chunk at a time, vectorised; InputError naming
    the file and the first id past the vocabulary (or negative), or that no eos is there."""
    vocab, eos, found = tokenizer.vocab_size, tokenizer.eos_id, []
    for start in range(0, len(ids), CHUNK_TOKENS):
        chunk = ids[start:start + CHUNK_TOKENS]
        if int(chunk.max()) >= vocab or (chunk.dtype.kind == "i" and int(chunk.min()) < 0):
            i = int(np.flatnonzero((chunk >= vocab) | (chunk < 0))[0])
            raise InputError(f"{path}: token {start + i:,} (byte "
                             f"{offset + (start + i) * ids.dtype.itemsize:,}): id "
                             f"{int(chunk[i])} is outside the tokenizer's vocabulary (0.."
                             f"{vocab - 1}, {tokenizer.path})")
        found.append(np.flatnonzero(chunk == eos) + start)
    positions = np.concatenate(found) if found else np.zeros(0, np.int64)
    if not len(positions):
        raise InputError(f"{path}: byte {offset:,}: no eos (id {eos}, {tokenizer.eos_token!r}) in "
                         f"its {len(ids):,} ids, so no document ends; are they this "
                         "tokenizer's ids?")
    return positions.astype(np.int64, copy=False)


def expand_files(files: list[str]) -> list[str]:
    """Local paths or globs -> the files, in argument order, each glob sorted (memory maps need
    local files)."""
    out: list[str] = []
    for name in files:
        if "://" in name and not name.startswith("file://"):
            raise ConfigError(f"{name}: scse-data import memory-maps local files; copy it here "
                              "first")
        name = name.removeprefix("file://")
        found = sorted(glob.glob(name)) if glob.has_magic(name) else [name]
        if not found or not os.path.exists(found[0]):
            raise FileNotFoundError(f"input {name!r} matches no file")
        out.extend(found)
    return out


def read_token_files(files: list[str], fmt: str, tokenizer: Tokenizer) -> list[TokenFile]:
    """Every file opened and checked (open_ids, check_ids), so bad input stops the import before
    anything is written."""
    read = []
    for path in expand_files(files):
        ids, offset = open_ids(path, fmt)
        read.append(TokenFile(path, ids, offset, check_ids(path, ids, offset, tokenizer)))
    return read


def documents(files: list[TokenFile]) -> Iterator[np.ndarray]:
    """The documents of the files read as one stream: the runs of ids between eos, empty ones
    dropped; the run after a file's last eos goes on in the next file."""
    carry: list[np.ndarray] = []
    for f in files:
        starts = np.concatenate([[0], f.eos + 1])
        ends = np.concatenate([f.eos, [len(f.ids)]])
        first = np.concatenate([*carry, f.ids[:ends[0]]]) if carry else f.ids[:ends[0]]
        if len(first):
            yield first
        for a, b in zip(starts[1:-1].tolist(), ends[1:-1].tolist()):
            if b > a:
                yield f.ids[a:b]
        tail = f.ids[starts[-1]:]
        carry = [tail] if len(tail) else []
    if carry:
        yield carry[0]


def import_tokens(files: list[TokenFile], tokenizer: Tokenizer, out: str,
                  heldout_fraction: float = 0.0, shard_bytes: int = 256 * 2**20,
                  sample_tokens: int = 65536) -> dict:
    """Write the documents of `files` (read_token_files) as shards under `out` by the write rule;
    return the index. A document is held out as `scse-data shards` holds out its decoded text."""
    check_layout(heldout_fraction, sample_tokens, shard_bytes)
    meta = shard_meta(tokenizer, sample_tokens, [f.path for f in files])
    with shards_output(out) as tmp:
        fs, root = fsspec.core.url_to_fs(tmp)
        writers = split_writers(fs, root, meta["dtype"], tokenizer.eos_id, sample_tokens,
                                shard_bytes)
        n = 0
        for doc in documents(files):
            held = heldout_fraction > 0 and is_heldout(tokenizer.decode(doc.tolist()),
                                                       heldout_fraction)
            writers["heldout" if held else "train"].add(doc)
            n += 1
        if n == 0:
            raise no_documents(out)
        return finish_index(fs, root, writers, meta)
