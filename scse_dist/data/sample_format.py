"""The sample layout of scse-tokens-v2 (format: shards.py): the format name, a sample's two npy
members, the sample table's columns and the npy codec. It imports nothing from scse_dist, so the
writer (shards.py) and the reader (reader.py) both import it and never each other.
"""

from __future__ import annotations

import io
import re
from typing import Any

import fsspec
import numpy as np

FORMAT = "scse-tokens-v2"
Sample = tuple[np.ndarray, np.ndarray]  # (tokens, doc_lens)
MEMBERS = ("tokens.npy", "doc_lens.npy")
TABLE_COLUMNS = ("tokens", "documents", "tokens_offset", "tokens_bytes", "lens_offset",
                 "lens_bytes")


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|]?[ui][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}")


def load_npy(data: bytes) -> np.ndarray:
    """np.load for the 1-D integer arrays the writer makes, without np.load's costly literal_eval
    of the header; anything else goes to np.load."""
    if data[:8] == b"\x93NUMPY\x01\x00":
        end = 10 + int.from_bytes(data[8:10], "little")
        m = _NPY_HEADER.match(data, 10, end)
        if m is not None:
            dtype = np.dtype(m.group(1).decode())
            count = int(m.group(2))
            if len(data) - end != count * dtype.itemsize:
                raise ValueError(f"array of {count} x {dtype} has {len(data) - end} bytes")
            return np.frombuffer(data, dtype, count, offset=end)
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_sample(parts: dict[str, Any], where: str, eos: int, vocab_size: int) -> Sample:
    """Member bytes -> (tokens, doc_lens); ValueError naming `where` when they do not fit: the
    lengths, the eos after each document, and every id below `vocab_size` (one max() per sample:
    a flipped byte would otherwise index past the embedding)."""
    missing = [m for m in MEMBERS if m not in parts]
    if missing:
        raise ValueError(f"{where}: missing member(s) {missing}")
    try:
        tokens, lens = (load_npy(parts[m]) for m in MEMBERS)
    except Exception as exc:
        raise ValueError(f"{where}: undecodable array ({type(exc).__name__}: {exc})") from None
    if tokens.ndim != 1 or lens.ndim != 1 or int(lens.sum()) + len(lens) != len(tokens):
        raise ValueError(f"{where}: doc_lens sum {int(lens.sum())} + {len(lens)} eos != "
                         f"{len(tokens)} tokens")
    if len(lens) and not (tokens[np.cumsum(lens + 1, dtype=np.int64) - 1] == eos).all():
        raise ValueError(f"{where}: a document does not end in eos {eos}")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"{where}: token id {int(tokens.max())} past the vocabulary "
                         f"(vocab_size {vocab_size})")
    return tokens, lens


def load_sample_table(url: str, n_samples: int) -> np.ndarray:
    """A shard's sample table (see TABLE_COLUMNS); ValueError naming the file when it is bad."""
    try:
        with fsspec.open(url, "rb") as f:
            table = load_npy(f.read())
    except Exception as exc:
        raise ValueError(f"{url}: unreadable sample table ({type(exc).__name__}: {exc})") from None
    if table.shape != (n_samples, len(TABLE_COLUMNS)) or table.dtype.kind not in "iu":
        raise ValueError(f"{url}: sample table of shape {table.shape}, expected "
                         f"({n_samples}, {len(TABLE_COLUMNS)}) integers")
    return table
