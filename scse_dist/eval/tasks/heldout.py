"""heldout: perplexity on a data dir's held-out shards (index.json; its heldout split, up to
eval.max_batches), or on any JSONL/text corpus, each document scored on its own. validation: the
same on the text `eval.task_settings.validation.path` names, where a study makes its choices (a
study's `validation:`), kept apart from heldout, a test set."""

from __future__ import annotations

from scse_dist.data.sources import read_corpus
from scse_dist.eval.task_run import TaskRun, document_rows, task_progress
from scse_dist.task_registry import DataFile, Task, register


def heldout_rows(run: TaskRun) -> list[dict]:
    """Held-out shards (their heldout split, up to max_batches), or a corpus: every document
    scored on its own, windows without overlap."""
    if not run.shards:
        return document_rows(run.model, run.tokenizer, run.inputs, run.depths, run.seq_len,
                             run.seq_len, run.batch_size, run.exit_stats, run.desc)
    from scse_dist.eval.perplexity import evaluate_heldout  # imports torch

    run.extra["max_batches"] = run.max_batches
    with task_progress(run.desc, run.max_batches or None, "batch") as bar:
        return evaluate_heldout(run.model, run.inputs, run.depths, max_batches=run.max_batches,
                                exit_stats=run.exit_stats, progress=bar, eos_id=run.inputs.eos)


TASK = register(Task("heldout", read_corpus, heldout_rows, metrics=("ppl", "loss"),
                     table=("ppl", "loss"), report=("ppl",), heldout=True))
VALIDATION = register(Task("validation", read_corpus, heldout_rows, metrics=("ppl", "loss"),
                           table=("ppl", "loss"), report=("ppl",), settings=DataFile,
                           heldout=True))
