"""The multiple-choice tasks (hellaswag, piqa, arc_easy, arc_challenge, multiple_choice): their
readers, one per local JSONL format (docs/evaluation.md), and their scorer, lm-eval's
`output_type: multiple_choice`.

Each reader builds the context and answers lm-eval's task of the same name builds (its
`doc_to_text` and `doc_to_choice`), one `Choices` record per question; bad input is one
InputError naming the file and line. Each answer is a (context, " " + answer) request scored as
LAMBADA's target is (task_run.context_target_ids). Per question, as lm-eval's process_results
(first index on a tie): accuracy, acc_norm and acc_bytes are whether the argmax of the answers'
log-likelihoods, per character, per UTF-8 byte, is the label.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

from scse_dist.cli_errors import InputError
from scse_dist.data.sources import jsonl_values, single_file, text_lines
from scse_dist.eval.task_run import TaskRun, context_target_ids, score_items
from scse_dist.task_registry import DataFile, Task, register

if TYPE_CHECKING:
    from scse_dist.eval.scoring import Score, Window


class Choices(NamedTuple):
    context: str
    # The answers as lm-eval's doc_to_choice gives them: each is scored as " " + answer after the
    # context, and acc_norm divides its log-likelihood by len(answer) in characters.
    choices: tuple[str, ...]
    label: int  # index of the right answer


def _objects(url: str) -> Iterator[tuple[str, dict]]:
    """("file:line", object) of every non-blank JSONL line; a line that is no object is refused."""
    for where, obj in jsonl_values(url):
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield where, obj


def _field(obj: dict, name: str, kind: type, where: str) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(f"{where}: expected a {kind.__name__} field {name!r}, got "
                         f"{type(value).__name__ if name in obj else 'none'}")
    return value


def _strings(value: Any, name: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) < 2 or \
            not all(isinstance(v, str) and v.strip() for v in value):
        raise InputError(f"{where}: {name!r} must be a list of at least 2 non-empty strings")
    return tuple(value)


def _index(label: Any, n: int, where: str) -> int:
    """A label as int (HellaSwag and PIQA write it as "2" in some releases), checked in 0..n-1."""
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < n:
        raise InputError(f"{where}: label {label!r} is not an answer index 0..{n - 1}")
    return label


def _read(url: str, convert: Callable[[dict, str], Choices]) -> list[Choices]:
    url = single_file(url)
    out = [convert(obj, where) for where, obj in _objects(url)]
    if not out:
        raise InputError(f"{url}: no questions (empty file?)")
    return out


def _generic(obj: dict, where: str) -> Choices:
    choices = _strings(obj.get("choices"), "choices", where)
    return Choices(_field(obj, "context", str, where), choices,
                   _index(obj.get("label"), len(choices), where))


def read_multiple_choice(url: str) -> list[Choices]:
    """The generic schema: {"context": str, "choices": [str, ...], "label": int} per line."""
    return _read(url, _generic)


def _hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's bracketed artifacts out, double spaces single."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(obj: dict, where: str) -> Choices:
    if "ctx_a" in obj:  # lm-eval: ctx_a + " " + ctx_b.capitalize()
        ctx = _field(obj, "ctx_a", str, where) + " " + _field(obj, "ctx_b", str, where).capitalize()
    else:
        ctx = _field(obj, "ctx", str, where)
    label = obj.get("activity_label")
    query = _hellaswag_text(f"{label}: {ctx}" if isinstance(label, str) else ctx)
    endings = _strings(obj.get("endings"), "endings", where)
    return Choices(query, tuple(_hellaswag_text(e) for e in endings),
                   _index(obj.get("label"), len(endings), where))


def read_hellaswag(url: str) -> list[Choices]:
    return _read(url, _hellaswag)


def _piqa_labels(url: str) -> list[str]:
    """The original release's labels beside its JSONL: valid.jsonl -> valid-labels.lst."""
    stem = re.sub(r"\.(jsonl|json|ndjson)$", "", url)
    path = stem + "-labels.lst"
    try:
        return [line.strip() for _, line in text_lines(path) if line.strip()]
    except FileNotFoundError:
        raise InputError(f"{url}: PIQA rows without 'label' need the labels file {path}") from None


def read_piqa(url: str) -> list[Choices]:
    url = single_file(url)
    rows = list(_objects(url))
    labels: list[Any] = [obj.get("label") for _, obj in rows]
    if rows and any(label is None for label in labels):
        labels = _piqa_labels(url)
        if len(labels) != len(rows):
            raise InputError(f"{url}: {len(rows)} questions but {len(labels)} labels in its "
                             "labels file")
    out = []
    for (where, obj), label in zip(rows, labels):
        goal = _field(obj, "goal", str, where)
        choices = (_field(obj, "sol1", str, where), _field(obj, "sol2", str, where))
        out.append(Choices(f"Question: {goal}\nAnswer:", choices, _index(label, 2, where)))
    if not out:
        raise InputError(f"{url}: no questions (empty file?)")
    return out


def _arc(obj: dict, where: str) -> Choices:
    texts: Sequence[Any]  # the rows' raw choice texts, then the checked strings
    question = obj.get("question")
    if isinstance(question, dict):  # AI2's JSONL: question.stem, question.choices [{text, label}]
        stem = _field(question, "stem", str, where)
        entries = question.get("choices")
        if not isinstance(entries, list) or not all(isinstance(c, dict) for c in entries):
            raise InputError(f"{where}: 'question.choices' must be a list of {{text, label}}")
        texts = [c.get("text") for c in entries]
        keys = [c.get("label") for c in entries]
    else:  # the HF rows: question str, choices {text: [...], label: [...]}
        stem = _field(obj, "question", str, where)
        choices = _field(obj, "choices", dict, where)
        texts, keys = choices.get("text"), choices.get("label")
    texts = _strings(texts, "choices' text", where)
    answer = _field(obj, "answerKey", str, where)
    if not isinstance(keys, list) or len(keys) != len(texts) or answer not in keys:
        raise InputError(f"{where}: answerKey {answer!r} is not one of the choices' labels {keys}")
    return Choices(f"Question: {stem}\nAnswer:", texts, keys.index(answer))


def read_arc(url: str) -> list[Choices]:
    return _read(url, _arc)


TARGET_DELIMITER = " "  # lm-eval's default, between the context and each answer


def choice_windows(tokenizer, questions: list[Choices], seq_len: int
                   ) -> tuple[list[Window], list[int]]:
    """Every answer's window, question by question, and the question each belongs to."""
    from scse_dist.eval.scoring import context_target_window  # imports torch

    owner = [i for i, q in enumerate(questions) for _ in q.choices]
    return [context_target_window(*context_target_ids(tokenizer, q.context, TARGET_DELIMITER + a),
                                  tokenizer.eos_id, seq_len)
            for q in questions for a in q.choices], owner


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # the first of equal maxima


def question_totals(questions: list[Choices], lls: list[list[float]]) -> dict:
    """Right answers over `questions` given each one's answers' log-likelihoods (additive)."""
    correct = correct_norm = correct_bytes = 0
    for q, ll in zip(questions, lls):
        correct += _argmax(ll) == q.label
        correct_norm += _argmax([v / len(a) for v, a in zip(ll, q.choices)]) == q.label
        correct_bytes += _argmax([v / len(a.encode("utf-8"))
                                  for v, a in zip(ll, q.choices)]) == q.label
    return {"correct": correct, "correct_norm": correct_norm, "correct_bytes": correct_bytes,
            "examples": len(lls)}


def _totals(depths: list[int], scores: list[list[Score]], owner: list[int],
            questions: list[Choices]) -> list[dict]:
    """Per depth the totals over the questions (owner[k]: the question of answer window k)."""
    out = []
    for d, per_window in zip(depths, scores):
        lls: list[list[float]] = [[] for _ in questions]
        for i, score in zip(owner, per_window):
            lls[i].append(-score.nll)
        out.append({"depth": d, **question_totals(questions, lls)})
    return out


def mc_metrics(totals: dict) -> dict:
    """One depth's row from its totals (mc_totals, or their sum over ranks)."""
    n = totals["examples"]
    return {"depth": totals["depth"], "accuracy": totals["correct"] / n,
            "acc_norm": totals["correct_norm"] / n, "acc_bytes": totals["correct_bytes"] / n,
            "examples": int(n)}


def mc_totals(run: TaskRun) -> list[dict]:
    """Per depth {"depth", "correct", "correct_norm", "correct_bytes", "examples"} over
    run.inputs (Choices). Ctrl-C: TaskInterrupted with the rows of the questions done."""
    windows, owner = choice_windows(run.tokenizer, run.inputs, run.seq_len)
    return score_items(run.model, windows, owner, run.inputs, run.depths, run.batch_size,
                   run.exit_stats, run.desc, "answer", "question", _totals, mc_metrics)


def mc_task_rows(run: TaskRun) -> list[dict]:
    return [mc_metrics(t) for t in mc_totals(run)]


READERS = {"hellaswag": read_hellaswag, "piqa": read_piqa, "arc_easy": read_arc,
           "arc_challenge": read_arc, "multiple_choice": read_multiple_choice}
for _name, _reader in READERS.items():  # each reads eval.task_settings.<name>.path
    register(Task(_name, _reader, mc_task_rows, metrics=("acc_norm", "accuracy", "acc_bytes"),
                  table=("accuracy", "acc_norm"), report=("acc_norm", "accuracy"),
                  higher_is_better=("acc_norm", "accuracy", "acc_bytes"),
                  settings=DataFile, totals=mc_totals, from_totals=mc_metrics))
