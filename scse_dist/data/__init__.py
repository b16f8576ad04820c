"""Data: sentencepiece tokenizer, document sources, token shards + index, packed token stream."""

from scse_dist.data.quickstart import ensure_data
from scse_dist.data.shards import read_index, write_shards
from scse_dist.data.sources import iter_documents
from scse_dist.data.stream import TokenStream
from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["Tokenizer", "TokenStream", "ensure_data", "iter_documents", "read_index",
           "train_tokenizer", "write_shards"]
