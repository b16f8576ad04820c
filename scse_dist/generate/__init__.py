"""Generation: greedy, temperature and top-p decoding over the loop-step KV cache (core.py), and
self-speculative decoding (speculative.py); the `scse-generate` command (cli.py).

The names below are imported on first use, so `scse-generate --help` starts without torch:
`from scse_dist.generate import generate, Sampling` loads torch only when it is asked for."""

import importlib

_EXPORTS = {
    "generate": "core", "Generation": "sampling", "left_pad": "sampling",
    "next_tokens": "sampling", "token_probs": "sampling", "speculative_generate": "speculative",
    "AdaptiveDraft": "options", "CACHE_CHOICES": "options", "DraftTokens": "options",
    "Sampling": "options", "parse_speculative": "options", "TextStream": "text",
    "continuation_text": "text",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
