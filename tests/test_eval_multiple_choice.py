"""Multiple-choice tasks: the local formats' readers, lm-eval's acc / acc_norm / acc_bytes against
log-likelihoods computed by direct forwards, and scse-eval --task on them. Tiny files made here."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_VOCAB
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.config import config_from_dict
from scse_dist.data.sources import read_corpus
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.eval.cli import main
from scse_dist.eval.task_run import run_task
from scse_dist.eval.tasks.lambada import read_lambada
from scse_dist.eval.tasks.multiple_choice import (
    Choices,
    mc_metrics,
    question_totals,
    read_arc,
    read_hellaswag,
    read_multiple_choice,
    read_piqa,
)
from scse_dist.model import LoopedLM

# Answers of very different lengths, so that acc and acc_norm can disagree.
QUESTIONS = [
    ("The cat sees", ["the red ball today.", "a quiet house with great care in the park again."]),
    ("My sister paints", ["the blue river at night.", "it.", "the bright moon again and again."]),
    ("A small bird reads", ["an open door.", "the tall tree in the park with great care."]),
    ("Our teacher finds", ["a green box today.", "the old man.", "the robot builds a house."]),
    ("The robot builds", ["a quiet house.", "the red ball in the park at night."]),
    ("A dog likes", ["the bright moon at night.", "an open door again and again."]),
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_data):
    cfg = config_from_dict({"name": "tiny",
                            "data": {"seq_len": 64, "tokenizer": tiny_data["tokenizer"]},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 160, "depth": 2},
                            "eval": {"batch_size": 3}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    return save_exported_model(model.state_dict(), cfg,
                               str(tmp_path_factory.mktemp("mc") / "export"))


def _direct_lls(model, tok, context, answers, depth):
    """Each answer's summed log-likelihood after the context, from a forward of its own."""
    out = []
    for answer in answers:
        c, full = tok.encode(context), tok.encode(context + " " + answer)
        assert full[:len(c)] == c  # the target is what the answer adds
        n = len(full) - len(c)
        x = torch.tensor([[tok.eos_id, *full]])
        with torch.no_grad():
            logits = model(x[:, :-1], depth=depth).logits[0, -n:].float()
        out.append(-float(F.cross_entropy(logits, x[0, -n:], reduction="sum")))
    return out


def _argmax(values):
    return max(range(len(values)), key=values.__getitem__)


def test_accuracy_and_acc_norm_equal_direct_log_likelihoods(export, tiny_data, tmp_path):
    model, cfg = load_exported_model(export)
    tok = Tokenizer.load(tiny_data["tokenizer"])
    lls = {d: [_direct_lls(model, tok, c, a, d) for c, a in QUESTIONS] for d in (1, 2)}
    # the labels: the model's own best answer (by summed LL at depth 1) for the first four,
    # another one for the last two, so accuracy at depth 1 is known: 4 of 6
    labels = [_argmax(ll) if i < 4 else 1 - min(_argmax(ll), 1)
              for i, ll in enumerate(lls[1])]
    path = _write(tmp_path / "mc.jsonl", [{"context": c, "choices": a, "label": y}
                                          for (c, a), y in zip(QUESTIONS, labels)])
    rows = run_task("multiple_choice", model, cfg, path, [1, 2], str(tmp_path / "r.json"), "x")
    assert rows[0]["accuracy"] == 4 / 6
    for row in rows:
        ll = lls[row["depth"]]
        norm = [_argmax([v / len(s) for v, s in zip(q, a)]) for q, (_, a) in zip(ll, QUESTIONS)]
        assert row["examples"] == 6
        assert row["accuracy"] == sum(_argmax(q) == y for q, y in zip(ll, labels)) / 6
        assert row["acc_norm"] == sum(p == y for p, y in zip(norm, labels)) / 6
    # the lengths matter here: acc_norm picks another answer than acc somewhere
    assert any(_argmax(q) != _argmax([v / len(s) for v, s in zip(q, a)])
               for q, (_, a) in zip(lls[1], QUESTIONS))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["task"] == "multiple_choice" and saved["results"] == rows


def test_acc_norm_divides_by_characters_and_acc_bytes_by_utf8_bytes():
    q = Choices("x", ("ab", "abcdefgh"), 1)
    # summed LL picks answer 0; per character (-5 vs -1.5) answer 1
    assert question_totals([q], [[-10.0, -12.0]]) == {
        "correct": 0, "correct_norm": 1, "correct_bytes": 1, "examples": 1}
    # "éé" is 2 characters but 4 bytes: per character answer 1 (-3 vs -2.67), per byte 0 (-1.5)
    q = Choices("x", ("éé", "abc"), 0)
    assert question_totals([q], [[-6.0, -8.0]]) == {
        "correct": 1, "correct_norm": 0, "correct_bytes": 1, "examples": 1}
    # a tie goes to the first answer, as np.argmax
    assert question_totals([Choices("x", ("a", "b"), 0)], [[-1.0, -1.0]])["correct"] == 1
    assert mc_metrics({"depth": 4, "correct": 3, "correct_norm": 1, "correct_bytes": 2,
                       "examples": 4}) == {"depth": 4, "accuracy": 0.75, "acc_norm": 0.25,
                                           "acc_bytes": 0.5, "examples": 4}


def test_hellaswag_piqa_and_arc_formats_read_as_lm_eval_builds_them(tmp_path):
    hs = _write(tmp_path / "hellaswag_val.jsonl", [
        {"activity_label": "Baking cookies", "ctx_a": "A woman mixes flour.", "ctx_b": "she",
         "endings": ["adds [title] sugar.", "adds  eggs [step] slowly."], "label": "1"},
        {"ctx": "A man runs.", "endings": ["fast.", "slow."], "label": 0}])
    assert read_hellaswag(hs) == [
        Choices("Baking cookies: A woman mixes flour. She",
                ("adds. sugar.", "adds eggs slowly."), 1),
        Choices("A man runs.", ("fast.", "slow."), 0)]
    piqa = _write(tmp_path / "valid.jsonl", [{"goal": "Open a jar", "sol1": "twist", "sol2": "cut"},
                                             {"goal": "Dry hair", "sol1": "towel", "sol2": "oven"}])
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    assert read_piqa(piqa) == [Choices("Question: Open a jar\nAnswer:", ("twist", "cut"), 0),
                               Choices("Question: Dry hair\nAnswer:", ("towel", "oven"), 1)]
    with_label = _write(tmp_path / "piqa.jsonl",
                        [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}])
    assert read_piqa(with_label) == [Choices("Question: g\nAnswer:", ("a", "b"), 1)]
    hf = _write(tmp_path / "arc_hf.jsonl", [
        {"question": "Which is hot?", "choices": {"text": ["ice", "fire"], "label": ["A", "B"]},
         "answerKey": "B"}])
    ai2 = _write(tmp_path / "arc_ai2.jsonl", [
        {"question": {"stem": "Which is hot?", "choices": [{"text": "ice", "label": "1"},
                                                           {"text": "fire", "label": "2"}]},
         "answerKey": "2"}])
    assert read_arc(hf) == read_arc(ai2) == [Choices("Question: Which is hot?\nAnswer:",
                                                     ("ice", "fire"), 1)]


@pytest.mark.parametrize("reader, rows, message", [
    (read_multiple_choice, [{"context": "c", "choices": ["a", "b"], "label": 2}],
     "mc.jsonl:1: label 2 is not an answer index 0..1"),
    (read_multiple_choice, [{"context": "c", "choices": ["a"], "label": 0}],
     "mc.jsonl:1: 'choices' must be a list of at least 2 non-empty strings"),
    (read_multiple_choice, [{"choices": ["a", "b"], "label": 0}],
     "mc.jsonl:1: expected a str field 'context', got none"),
    (read_arc, [{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                 "answerKey": "C"}],
     "mc.jsonl:1: answerKey 'C' is not one of the choices' labels ['A', 'B']"),
    (read_piqa, [{"goal": "g", "sol1": "a", "sol2": "b"}],
     "mc.jsonl: PIQA rows without 'label' need the labels file "),
    (read_hellaswag, [], "mc.jsonl: no questions (empty file?)"),
])
def test_bad_multiple_choice_data_names_file_and_line(tmp_path, reader, rows, message):
    path = _write(tmp_path / "mc.jsonl", rows)
    with pytest.raises(ValueError, match=re.escape(message)):
        reader(path)


@pytest.mark.parametrize("reader", [read_multiple_choice, read_hellaswag, read_piqa, read_arc,
                                    read_lambada, read_corpus])
def test_every_jsonl_reader_names_a_bad_line_alike(tmp_path, reader):
    """One JSONL parser (data.sources.jsonl_values) under the tasks' files and the corpora."""
    path = tmp_path / "bad.jsonl"
    path.write_text('\n{"text": "a" "b"}\n')
    with pytest.raises(ValueError) as exc:
        reader(str(path))
    assert str(exc.value) == f"{path}:2: not valid JSON (Expecting ',' delimiter at column 14)"


def test_scse_eval_runs_each_multiple_choice_task(export, tmp_path, capsys):
    path = _write(tmp_path / "arc.jsonl", [
        {"question": c, "choices": {"text": a, "label": [str(i) for i in range(len(a))]},
         "answerKey": "0"} for c, a in QUESTIONS])
    out = tmp_path / "arc.json"
    assert main(["--checkpoint", export, "--task", "arc_easy", "--data", path, "--depths", "1,2",
                 "--out", str(out)]) == 0
    assert "| depth | accuracy | acc_norm |" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert [r["depth"] for r in saved["results"]] == [1, 2]
    assert all(r["examples"] == 6 and 0 <= r["acc_norm"] <= 1 for r in saved["results"])
