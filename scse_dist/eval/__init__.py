"""Evaluation: held-out, WikiText, LAMBADA and diagnostic tasks at several loop depths (one forward
per batch), results JSON and tables, reports, `scse-eval`, `scse-report`.

The names below are imported on first use, so `scse-report` starts without torch."""

import importlib

_EXPORTS = {"evaluate_heldout": "perplexity", "format_table": "results", "write_results": "results",
            # run_heldout_eval lives with the CLI
            "run_heldout_eval": "cli"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"scse_dist.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'scse_dist.eval' has no attribute {name!r}")
