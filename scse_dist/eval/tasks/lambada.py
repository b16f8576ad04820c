"""lambada: last-word prediction, accuracy (every target token is the argmax) and ppl per passage,
both as lm-eval's LAMBADA tasks define them, from the OpenAI JSONL or one passage per line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from scse_dist.cli_errors import InputError
from scse_dist.data.sources import is_jsonl, jsonl_values, single_file, text_lines
from scse_dist.eval.task_run import TaskRun, context_target_ids, safe_exp, score_items
from scse_dist.task_registry import DataFile, Task, register

if TYPE_CHECKING:
    from scse_dist.eval.scoring import Score


class Passage(NamedTuple):
    context: str
    target: str  # " " + the last word


def _split_passage(text: str, where: str) -> Passage:
    """lm-eval's official LAMBADA split (lambada_openai.yaml): context `text.split(' ')[:-1]`
    joined by ' ', target `' ' + text.split(' ')[-1]` (a newline before the last word stays in
    the target, as lm-eval scores it)."""
    words = text.split(" ")
    context, last = " ".join(words[:-1]), words[-1]
    if not context.strip() or not last.strip():
        why = ("has no word after its last space" if context.strip()
               else "has no context before its last word")
        raise InputError(f"{where}: passage {why}: {text.strip()[:60]!r}")
    return Passage(context, " " + last)


def read_lambada(url: str) -> list[Passage]:
    """LAMBADA passages (context, " " + last word) from OpenAI JSONL or one-passage-per-line
    text, split as lm-eval's LAMBADA task splits them (_split_passage). A JSONL passage is its
    `text` as it is; a plain-text passage is its line without trailing whitespace."""
    url = single_file(url)
    out = []
    if is_jsonl(url):
        for where, obj in jsonl_values(url):
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InputError(f"{where}: expected an object with a string field 'text'")
            out.append(_split_passage(obj["text"], where))
    else:
        out = [_split_passage(line.rstrip(), f"{url}:{lineno}")
               for lineno, line in text_lines(url) if line.strip()]
    if not out:
        raise InputError(f"{url}: no passages (empty file?)")
    return out


def lambada_totals(run: TaskRun) -> list[dict]:
    """Per depth the additive totals over run.inputs' passages (in training summed over ranks).
    Ctrl-C: TaskInterrupted with the rows of the passages scored."""
    from scse_dist.eval.scoring import context_target_window  # imports torch

    windows = [context_target_window(*context_target_ids(run.tokenizer, p.context, p.target),
                                     run.tokenizer.eos_id, run.seq_len) for p in run.inputs]
    return score_items(run.model, windows, list(range(len(windows))), run.inputs, run.depths,
                   run.batch_size, run.exit_stats, run.desc, "passage", "passage",
                   _lambada_totals, lambada_metrics)


def _lambada_totals(depths: list[int], scores: list[list[Score]], owner: list[int],
                    passages: list[Passage]) -> list[dict]:
    """Per depth the additive totals of the passages' scores (summed over ranks in training)."""
    return [{"depth": d, "correct": sum(s.all_correct for s in per_window),
             "nll": sum(s.nll for s in per_window),
             "target_tokens": sum(s.count for s in per_window), "examples": len(per_window)}
            for d, per_window in zip(depths, scores)]


def lambada_metrics(totals: dict) -> dict:
    """One depth's row from its totals (_lambada_totals, or their sum over ranks), as lm-eval's
    LAMBADA tasks define acc and perplexity: accuracy = passages whose every target token is the
    argmax / passages; loss = mean over passages of the target's summed NLL, ppl = exp(loss):
    per passage, not per token."""
    n, nll = totals["examples"], totals["nll"]
    return {"depth": totals["depth"], "accuracy": totals["correct"] / n, "loss": nll / n,
            "ppl": safe_exp(nll / n), "examples": int(n),
            "target_tokens": int(totals["target_tokens"])}


def lambada_task_rows(run: TaskRun) -> list[dict]:
    """lm-eval's LAMBADA metrics (lambada_metrics) at each depth."""
    return [lambada_metrics(t) for t in lambada_totals(run)]


TASK = register(Task("lambada", read_lambada, lambada_task_rows,
                     metrics=("ppl", "accuracy", "loss"), table=("accuracy", "ppl"),
                     report=("accuracy", "ppl"), study_report=("ppl", "accuracy"),
                     higher_is_better=("accuracy",), settings=DataFile,
                     totals=lambada_totals, from_totals=lambada_metrics))
