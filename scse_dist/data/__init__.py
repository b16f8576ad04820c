"""Data: tokenizers, document sources, token shards + index, packed token stream. The names below
are imported on first use, so `scse-data` starts without torch."""

import importlib

_EXPORTS = {"ensure_data": "quickstart", "read_index": "index", "write_shards": "shards",
            "iter_documents": "sources", "TokenStream": "stream", "Tokenizer": "tokenizer",
            "train_tokenizer": "tokenizer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"scse_dist.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'scse_dist.data' has no attribute {name!r}")
