"""wikitext: WikiText raw, document-wise sliding window; ppl, word_ppl, bits_per_byte. Its
reader is a corpus format too, so it stays in scse_dist.data.sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from scse_dist.data.sources import read_wikitext_articles
from scse_dist.eval.task_run import TaskRun, document_metrics, document_totals
from scse_dist.task_registry import Task, register


@dataclass
class Config:
    """eval.task_settings.wikitext."""

    path: Optional[str] = None  # wiki.{valid,test}.raw path or URL
    # sliding-window stride in tokens; 0 means data.seq_len // 2
    stride: int = field(default=0, metadata={"ge": 0})


def wikitext_rows(run: TaskRun) -> list[dict]:
    run.extra["stride"] = run.stride
    return [document_metrics(t) for t in wikitext_totals(run)]


# During training: each rank's totals over its share, summed over ranks (registry `totals`).
def wikitext_totals(run: TaskRun) -> list[dict]:
    return document_totals(run.model, run.tokenizer, run.inputs, run.depths, run.seq_len,
                           run.stride, run.batch_size, run.exit_stats, run.desc)


TASK = register(Task("wikitext", read_wikitext_articles, wikitext_rows,
                     metrics=("ppl", "word_ppl", "bits_per_byte", "loss"),
                     table=("ppl", "word_ppl", "bits_per_byte"),
                     report=("word_ppl", "ppl", "bits_per_byte"),
                     study_report=("ppl", "word_ppl", "bits_per_byte"), settings=Config,
                     totals=wikitext_totals, from_totals=document_metrics))
