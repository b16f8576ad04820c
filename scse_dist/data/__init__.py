"""Data: tokenizers, document sources, token shards + index, packed token stream (docs/data.md)."""
