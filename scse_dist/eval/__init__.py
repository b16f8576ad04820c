"""Evaluation: held-out, WikiText, LAMBADA and diagnostic tasks at several loop depths (one forward
per batch), results JSON and tables, reports, `scse-eval`, `scse-report`."""

from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.eval.results import format_table, write_results

__all__ = ["evaluate_heldout", "format_table", "write_results"]
