"""Multiple-choice tasks (hellaswag, piqa, arc_easy, arc_challenge, multiple_choice), scored as
lm-eval scores its `output_type: multiple_choice` tasks.

Each answer is a (context, " " + answer) request (lm-eval's default target_delimiter), scored as
scse-eval scores LAMBADA's target: the window EOS + context + answer, the answer's ids being what
encoding context + answer adds after the context's own (scse_dist.eval.tasks.context_target_ids),
its log-likelihood the summed log-probability of those ids. Every answer of every question goes
into one list of windows, batched longest first, all depths in one loop run per batch.

Per question, as lm-eval's process_results (first index on a tie, as np.argmax):
    accuracy    argmax of the answers' log-likelihoods is the label       (lm-eval: acc)
    acc_norm    argmax of log-likelihood / len(answer) in characters      (lm-eval: acc_norm)
    acc_bytes   argmax of log-likelihood / len(answer) in UTF-8 bytes     (lm-eval: acc_bytes)
"""

from __future__ import annotations

from typing import Optional, Sequence

from scse_dist.data.multiple_choice import Choices
from scse_dist.eval.scoring import Score, Window, context_target_window
from scse_dist.eval.tasks import TaskRun, _scores, context_target_ids

TARGET_DELIMITER = " "  # lm-eval's default, between the context and each answer


def choice_windows(tokenizer, questions: list[Choices], seq_len: int
                   ) -> tuple[list[Window], list[int]]:
    """Every answer's window, question by question, and the question each belongs to."""
    windows, owner = [], []
    for i, q in enumerate(questions):
        for answer in q.choices:
            context, target = context_target_ids(tokenizer, q.context, TARGET_DELIMITER + answer)
            windows.append(context_target_window(context, target, tokenizer.eos_id, seq_len))
            owner.append(i)
    return windows, owner


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


def _totals(depths: list[int], scores: Sequence[Sequence[Optional[Score]]],
            questions: list[Choices], owner: list[int]) -> tuple[list[dict], int]:
    """Per depth the totals over the questions whose answers are all scored, and their count."""
    complete = [True] * len(questions)
    for i, score in zip(owner, scores[0]):
        complete[i] = complete[i] and score is not None
    out = []
    for d, per_window in zip(depths, scores):
        lls: list[list[float]] = [[] for _ in questions]
        for i, score in zip(owner, per_window):
            if complete[i]:
                assert score is not None  # complete: every window of question i was scored
                lls[i].append(-score.nll)
        done = [k for k, ok in enumerate(complete) if ok]
        out.append({"depth": d, **question_totals([questions[k] for k in done],
                                                  [lls[k] for k in done])})
    return out, sum(complete)


def mc_metrics(totals: dict) -> dict:
    """One depth's row from its totals (mc_totals, or their sum over ranks)."""
    n = totals["examples"]
    return {"depth": totals["depth"], "accuracy": totals["correct"] / n,
            "acc_norm": totals["correct_norm"] / n, "acc_bytes": totals["correct_bytes"] / n,
            "examples": int(n)}


def mc_totals(run: TaskRun) -> list[dict]:
    """Per depth {"depth", "correct", "correct_norm", "correct_bytes", "examples"} over
    run.inputs (a list of Choices; empty: zeros). Ctrl-C: TaskInterrupted with the rows of the
    questions whose answers were all scored."""
    questions: list[Choices] = run.inputs
    windows, owner = choice_windows(run.tokenizer, questions, run.seq_len)

    def per_question(depths: list[int], scores: list[list[Optional[Score]]]):
        totals, done = _totals(depths, scores, questions, owner)
        return [mc_metrics(t) for t in totals] if done else None, done, len(questions)

    depths, scores = _scores(run.model, windows, run.depths, run.batch_size, run.exit_stats,
                             run.desc, "answer", "question", per_question)
    return _totals(depths, scores, questions, owner)[0]


def mc_task_rows(run: TaskRun) -> list[dict]:
    return [mc_metrics(t) for t in mc_totals(run)]
