"""Evaluation tasks: WikiText sliding window, LAMBADA, diagnose, corpus held-out, bad data, CLI.
A tiny random model with the tiny_data tokenizer. (Loading a DeepSpeed checkpoint dir:
tests/test_export_portable.py.)"""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_VOCAB
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.config import config_from_dict
from scse_dist.data.sources import read_wikitext_articles
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.eval.cli import main
from scse_dist.eval.scoring import document_windows
from scse_dist.eval.task_run import run_task
from scse_dist.eval.tasks.diagnose import diagnose_rows
from scse_dist.eval.tasks.lambada import read_lambada
from scse_dist.model import LoopedLM

WIKI = (" \n = Robert Boulter = \n \n Robert Boulter is an English film and television actor . \n"
        " \n = = Career = = \n \n In 2000 Boulter had a guest @-@ starring role . \n \n"
        " = Du Fu = \n \n Du Fu was a prominent Chinese poet of the Tang dynasty . \n")
LAMBADA = ["the cat sees the red ball today . the dog likes the red ball",
           "a small bird reads an open door at night . our teacher finds the tall tree",
           "my sister paints the blue river . the robot builds a quiet house"]


def _model(recurrence="scse", **model):
    cfg = config_from_dict({"name": "tiny", "data": {"seq_len": 16},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 160, "depth": 2,
                                      "recurrence": recurrence, **model},
                            "eval": {"batch_size": 2}})
    torch.manual_seed(0)
    return LoopedLM(cfg.model).eval(), cfg


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_data):
    model, cfg = _model()
    cfg.data.tokenizer = tiny_data["tokenizer"]
    root = tmp_path_factory.mktemp("eval_tasks")
    return save_exported_model(model.state_dict(), cfg, str(root / "export")), root


def _direct_nll(model, ids, depth):
    """Summed NLL of ids[1:] given ids[:-1] from a separate forward at `depth`."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x[:, :-1], depth=depth).logits[0].float()
    return float(F.cross_entropy(logits, x[0, 1:], reduction="sum")), logits.argmax(-1).tolist()


def test_document_windows_score_every_target_once_with_carried_context():
    windows = document_windows(list(range(10, 20)), eos_id=2, seq_len=4, stride=2)
    seq = [2, *range(10, 20)]
    scored = []
    for w in windows:
        assert len(w.tokens) - 1 <= 4
        start = seq.index(w.tokens[0])
        scored += [start + 1 + i for i in range(w.first_scored, len(w.tokens) - 1)]
        if start:  # a later window sees seq_len - stride tokens of context before its first target
            assert w.first_scored == 2
    assert scored == list(range(1, 11))
    assert [len(w.tokens) for w in document_windows([5], 2, 4, 4)] == [2]
    with pytest.raises(ValueError, match="stride: must lie in 1..seq_len=4, got 5"):
        document_windows([1], 2, 4, 5)


def test_wikitext_articles_split_at_top_level_headings(tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(WIKI)
    articles = read_wikitext_articles(str(path))
    assert len(articles) == 2 and "= = Career = =" in articles[0] and "Du Fu" in articles[1]
    assert "".join(articles).strip() == WIKI.strip()


def test_wikitext_metrics_equal_direct_forwards_at_each_depth(export, tiny_data, tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(WIKI)
    model, cfg = load_exported_model(export[0])
    tok = Tokenizer.load(tiny_data["tokenizer"])
    rows = run_task("wikitext", model, cfg, str(path), [1, 3], str(tmp_path / "w.json"), "x",
                    stride=8)
    articles = read_wikitext_articles(str(path))
    words = len(WIKI.split())
    assert [r["depth"] for r in rows] == [1, 3] and rows[0]["words"] == words
    assert rows[0]["bytes"] == sum(len(a.encode()) for a in articles)
    for r in rows:
        nll = r["loss"] * r["tokens"]
        assert math.log(r["word_ppl"]) * words == pytest.approx(nll, rel=1e-9)
        assert r["bits_per_byte"] * math.log(2) * r["bytes"] == pytest.approx(nll, rel=1e-9)
        assert r["tokens"] == sum(len(tok.encode(a.strip())) for a in articles)
    # a window as long as the whole article equals one direct forward per article
    cfg.data.seq_len = 160
    rows = run_task("wikitext", model, cfg, str(path), [1, 3], str(tmp_path / "w.json"), "x")
    for r in rows:
        ids = [[tok.eos_id, *tok.encode(a.strip())] for a in articles]
        assert max(map(len, ids)) <= 161
        assert r["loss"] * r["tokens"] == pytest.approx(
            sum(_direct_nll(model, i, r["depth"])[0] for i in ids), rel=1e-5)
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["task"] == "wikitext" and data["stride"] == 80 and data["recurrence"] == "scse"


def test_lambada_accuracy_and_passage_ppl_equal_direct_forwards(export, tiny_data, tmp_path):
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    model, cfg = load_exported_model(export[0])
    tok = Tokenizer.load(tiny_data["tokenizer"])
    rows = run_task("lambada", model, cfg, str(path), [1, 2, 4], str(tmp_path / "l.json"), "x")
    for r in rows:
        nll = correct = n = 0
        for text in LAMBADA:
            context, word = text.rsplit(" ", 1)
            c, full = tok.encode(context), tok.encode(context + " " + word)
            assert full[:len(c)] == c
            ids = [tok.eos_id, *full][-17:]
            target = full[len(c):]
            total, argmax = _direct_nll(model, ids, r["depth"])
            x = torch.tensor([ids])
            with torch.no_grad():
                logits = model(x[:, :-1], depth=r["depth"]).logits[0].float()
            nll += float(F.cross_entropy(logits[-len(target):], x[0, -len(target):],
                                         reduction="sum"))
            correct += argmax[-len(target):] == target
            n += len(target)
        assert r["accuracy"] == correct / len(LAMBADA) and r["examples"] == 3
        # lm-eval's LAMBADA perplexity: per passage (mean target NLL), not per token
        assert r["ppl"] == pytest.approx(math.exp(nll / 3), rel=1e-5) and r["target_tokens"] == n
    # the plain-text format gives the same numbers
    plain = tmp_path / "lambada_development_plain_text.txt"
    plain.write_text("\n".join(LAMBADA) + "\n")
    assert run_task("lambada", model, cfg, str(plain), [1, 2, 4], str(tmp_path / "p.json"),
                    "x") == rows


@pytest.mark.parametrize("name, text, message", [
    ("l.jsonl", '{"text": "a b c"}\n{"text": "a b\n', "l.jsonl:2: not valid JSON"),
    ("l.jsonl", '{"text": "a b c"}\n\n{"txt": "a b"}\n',
     "l.jsonl:3: expected an object with a string field 'text'"),
    ("l.txt", "a b c\nlonely\n", "l.txt:2: passage has no context before its last word"),
    ("l.txt", "", "l.txt: no passages (empty file?)"),
])
def test_bad_lambada_data_names_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_lambada(str(tmp_path / name))


def test_bad_corpus_and_wikitext_name_the_file(export, tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": 3\n')
    (tmp_path / "empty.raw").write_text("")
    for task, name, message in [("heldout", "c.jsonl", "c.jsonl:2: not valid JSON"),
                                ("wikitext", "empty.raw", "empty.raw: no text"),
                                ("wikitext", "c.jsonl", "c.jsonl:1: looks like JSON")]:
        assert main(["--checkpoint", export[0], "--task", task, "--data", str(tmp_path / name),
                     "--out", str(tmp_path / "r.json")]) == 65
        err = capsys.readouterr().err
        assert err.startswith("scse-eval: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


def test_heldout_on_a_text_corpus_scores_whole_documents(export, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sees the red ball today .\n\n"
                    "the old man reads a green box at night .\n")
    model, cfg = load_exported_model(export[0])
    rows = run_task("heldout", model, cfg, str(path), [2], str(tmp_path / "h.json"), "x")
    assert rows[0]["documents"] == 2 and rows[0]["words"] == 8 + 10


@pytest.mark.parametrize("recurrence", ["scse", "additive"])
def test_diagnose_norms_match_the_model_states(recurrence):
    model, _ = _model(recurrence)
    torch.manual_seed(1)
    batch = torch.randint(3, TINY_VOCAB, (2, 9))
    rows = diagnose_rows(model, [batch], [1, 3])
    with torch.no_grad():
        s = model.source(batch[:, :-1])
        anchor = model.core.anchor_of(s)
        h = [model.core.initial_state(s), *model.core(s, 3, readout_depths=[1, 2, 3])]
    assert [r["depth"] for r in rows] == [1, 3]
    for r in rows:
        t = r["depth"]
        assert r["deviation_norm"] == pytest.approx(float((h[t] - anchor).norm(dim=-1).mean()))
        assert r["motion_norm"] == pytest.approx(float((h[t] - h[t - 1]).norm(dim=-1).mean()))
        assert r["bias_norm"] > 0
    if recurrence == "scse":  # SCSE proper: no forcing bias reaches a zero deviation
        assert rows[0]["effective_bias_norm"] == 0.0
    else:  # the additive loop's bias at the source anchor is Phi(s) - s
        with torch.no_grad():
            want = (model.core.phi(s, s) - s).norm(dim=-1).mean()
        assert rows[0]["effective_bias_norm"] == pytest.approx(float(want), rel=1e-5)
        assert rows[0]["bias_norm"] == pytest.approx(float(want), rel=1e-5)


def test_cli_diagnose_on_shards_writes_every_depth(export, tiny_data, tmp_path):
    out = tmp_path / "d.json"
    assert main(["--checkpoint", export[0], "--task", "diagnose", "--data", tiny_data["path"],
                 "--depths", "1,4", "--max-batches", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["task"] == "diagnose" and [r["depth"] for r in data["results"]] == [1, 4]
    assert {"bias_norm", "deviation_norm", "motion_norm"} <= set(data["results"][0])
