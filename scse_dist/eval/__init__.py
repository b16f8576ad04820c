"""Evaluation: held-out, WikiText, LAMBADA and diagnostic tasks at several loop depths (one forward
per batch), results JSON and tables, reports, `scse-eval`, `scse-report`."""

from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.eval.results import format_table, write_results

__all__ = ["evaluate_heldout", "format_table", "write_results", "run_heldout_eval"]


def __getattr__(name: str):
    # run_heldout_eval lives with the CLI; import it lazily so `scse_dist.eval` stays light.
    if name == "run_heldout_eval":
        from scse_dist.eval.cli import run_heldout_eval

        return run_heldout_eval
    raise AttributeError(name)
