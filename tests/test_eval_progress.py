"""Evaluation that uses its time well: windows batched longest first score exactly as in file
order, progress (items, rate, ETA) on stderr, and Ctrl-C writes the results of the items done,
marked partial, with one line saying how far it got (exit 130 from scse-eval)."""

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import time

import pytest
import torch

from conftest import TINY_VOCAB, sigint_default
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.cli_errors import Interrupted
from scse_dist.config import config_from_dict
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.eval import scoring as scorer_module
from scse_dist.eval.scoring import context_target_window, document_windows, score_windows
from scse_dist.eval.task_run import context_target_ids, run_task
from scse_dist.eval.tasks.lambada import read_lambada
from scse_dist.model import LoopedLM

WORDS = ("the cat sees the red ball today . a small bird reads an open door at night . our "
         "teacher finds the tall tree and my sister paints the blue river").split()


def _passages(n: int, seed: int = 0) -> list[str]:
    """n passages of 3..24 words (varied lengths, so sorting reorders them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 25, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)]
                            for i in torch.randint(len(WORDS), (length,), generator=g)))
    return out


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_data):
    cfg = config_from_dict({"name": "tiny",
                            "data": {"seq_len": 48, "tokenizer": tiny_data["tokenizer"]},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 64, "depth": 2},
                            "eval": {"batch_size": 3}})
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("eval_progress")
    return save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(root / "export"))


def _lambada_file(path, passages):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in passages))
    return str(path)


def test_sorted_batches_give_each_window_the_same_score_in_input_order(export, tiny_data,
                                                                       tmp_path):
    model, cfg = load_exported_model(export)
    tok = Tokenizer.load(tiny_data["tokenizer"])
    passages = read_lambada(_lambada_file(tmp_path / "l.jsonl", _passages(11)))
    windows = [context_target_window(*context_target_ids(tok, p.context, p.target), tok.eos_id,
                                     cfg.data.seq_len) for p in passages]
    assert len({len(w.tokens) for w in windows}) > 3  # the order really changes
    sorted_depths, by_length = score_windows(model, windows, [1, 3], batch_size=3)
    _, in_order = score_windows(model, windows, [1, 3], batch_size=3, sort=False)
    _, alone = score_windows(model, windows, [1, 3], batch_size=1)
    assert sorted_depths == [1, 3]
    # every count and argmax flag exactly, every nll to float rounding: batches of other padded
    # lengths reach the matmuls in other shapes, whose sums may round differently
    for a, b, c in zip(by_length, in_order, alone):
        assert [(s.count, s.all_correct) for s in a] == [(s.count, s.all_correct) for s in b] \
            == [(s.count, s.all_correct) for s in c]
        assert [s.nll for s in a] == pytest.approx([s.nll for s in c], rel=1e-6)
        assert [s.nll for s in b] == pytest.approx([s.nll for s in c], rel=1e-6)
    assert [s.count for s in by_length[0]] == [len(w.tokens) - 1 - w.first_scored for w in windows]


def _stop_after(monkeypatch, calls: int):
    """Ctrl-C arrives while the scorer runs its (calls+1)-th batch."""
    original = scorer_module.DepthScorer.__call__
    seen = []

    def call(self, inputs, targets):
        if len(seen) == calls:
            raise KeyboardInterrupt
        seen.append(len(inputs))
        return original(self, inputs, targets)

    monkeypatch.setattr(scorer_module.DepthScorer, "__call__", call)
    return seen


def test_ctrl_c_writes_the_passages_done_marked_partial(export, tmp_path, monkeypatch):
    model, cfg = load_exported_model(export)
    texts = _passages(8, seed=1)
    data = _lambada_file(tmp_path / "l.jsonl", texts)
    _stop_after(monkeypatch, 2)
    out = tmp_path / "partial.json"
    with pytest.raises(Interrupted) as stop:
        run_task("lambada", model, cfg, data, [1, 2], str(out), "x")
    assert str(stop.value) == (f"lambada: 6/8 passages scored (all depths in one pass); "
                               f"partial results in {out}")
    partial = json.loads(out.read_text())
    assert partial["partial"] == {"done": 6, "total": 8, "unit": "passage"}
    monkeypatch.undo()
    # the 6 done are the longest: their rows equal a full run on those 6 alone
    tok = Tokenizer.load(cfg.data.tokenizer)
    passages = read_lambada(data)
    length = [len(context_target_window(*context_target_ids(tok, p.context, p.target),
                                        tok.eos_id, cfg.data.seq_len).tokens) for p in passages]
    longest = sorted(range(8), key=lambda i: -length[i])[:6]
    alone = run_task("lambada", model, cfg, _lambada_file(tmp_path / "six.jsonl",
                                                          [texts[i] for i in longest]),
                     [1, 2], str(tmp_path / "six.json"), "x")
    assert partial["results"] == alone


def test_ctrl_c_before_any_batch_writes_nothing(export, tmp_path, monkeypatch):
    model, cfg = load_exported_model(export)
    _stop_after(monkeypatch, 0)
    with pytest.raises(Interrupted, match=r"^lambada: 0/4 passages scored \(all depths in one "
                                          r"pass\); no results written$"):
        run_task("lambada", model, cfg, _lambada_file(tmp_path / "l.jsonl", _passages(4)),
                 [1], str(tmp_path / "r.json"), "x")
    assert not (tmp_path / "r.json").exists()


def test_ctrl_c_in_heldout_keeps_the_batches_done(export, tiny_data, tmp_path, monkeypatch):
    model, cfg = load_exported_model(export)
    full = run_task("heldout", model, cfg, tiny_data["path"], [1, 2], str(tmp_path / "a.json"),
                    "x", max_batches=2)
    _stop_after(monkeypatch, 2)
    with pytest.raises(Interrupted, match=r"heldout: 2/3 batches scored .*partial results in "):
        run_task("heldout", model, cfg, tiny_data["path"], [1, 2], str(tmp_path / "b.json"), "x",
                 max_batches=3)
    partial = json.loads((tmp_path / "b.json").read_text())
    assert partial["partial"] == {"done": 2, "total": 3, "unit": "batch"}
    assert partial["results"] == full


def test_ctrl_c_in_wikitext_keeps_the_documents_whose_windows_all_scored(export, tmp_path,
                                                                         monkeypatch):
    """Disjoint windows, one per batch, longest first: the long article's last window is shorter
    than the short article's one, so stopping right after the short one leaves the long one
    incomplete, and the partial rows are the short article's, as if run alone."""
    model, cfg = load_exported_model(export)
    cfg.eval.batch_size, seq_len = 1, cfg.data.seq_len
    tok = Tokenizer.load(cfg.data.tokenizer)
    short = " = Short = \n the cat sees the red ball . \n"
    words = " ".join(_passages(40, seed=4)).split()
    n = next(n for n in range(60, len(words))  # the long one's last window: 2-5 tokens
             if 1 <= len(tok.encode(" = Long = \n " + " ".join(words[:n]))) % seq_len <= 4)
    long = " = Long = \n " + " ".join(words[:n]) + " \n"
    (tmp_path / "wiki.raw").write_text(long + short)
    windows = [(doc, len(w.tokens)) for doc, text in enumerate([long, short])
               for w in document_windows(tok.encode(text.strip()), tok.eos_id, seq_len, seq_len)]
    order = sorted(windows, key=lambda w: -w[1])
    batches = [doc for doc, _ in order].index(1) + 1  # up to the short article's one window
    assert [doc for doc, _ in order[batches:]] == [0]  # the long one's last window to go
    _stop_after(monkeypatch, batches)
    with pytest.raises(Interrupted, match=r"^wikitext: 1/2 documents scored .*partial results in "):
        run_task("wikitext", model, cfg, str(tmp_path / "wiki.raw"), [1, 2],
                 str(tmp_path / "p.json"), "x", stride=seq_len)
    partial = json.loads((tmp_path / "p.json").read_text())
    assert partial["partial"] == {"done": 1, "total": 2, "unit": "document"}
    monkeypatch.undo()
    (tmp_path / "short.raw").write_text(short)
    assert partial["results"] == run_task("wikitext", model, cfg, str(tmp_path / "short.raw"),
                                          [1, 2], str(tmp_path / "s.json"), "x", stride=seq_len)


def test_ctrl_c_in_multiple_choice_keeps_the_questions_whose_answers_all_scored(
        export, tmp_path, monkeypatch):
    """One answer per batch, longest first: the first question's long answer goes first and its
    short one last, so stopping before the last leaves only the second question complete, and
    the partial rows are that question's, as if run alone."""
    model, cfg = load_exported_model(export)
    cfg.eval.batch_size = 1
    first = {"context": "The cat sees", "label": 1,
             "choices": ["the red ball today and the blue river at night again", "it"]}
    second = {"context": "The cat sees", "label": 0,
              "choices": ["the tall tree today.", "an open door today."]}
    tok = Tokenizer.load(cfg.data.tokenizer)
    sizes = [len(tok.encode("The cat sees " + a)) for q in (first, second) for a in q["choices"]]
    assert sizes[0] > max(sizes[2:]) and sizes[1] < min(sizes[2:])  # the order described
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    _stop_after(monkeypatch, 3)
    with pytest.raises(Interrupted, match=r"^multiple_choice: 1/2 questions scored .*partial "):
        run_task("multiple_choice", model, cfg, str(data), [1, 2], str(tmp_path / "p.json"), "x")
    partial = json.loads((tmp_path / "p.json").read_text())
    assert partial["partial"] == {"done": 1, "total": 2, "unit": "question"}
    monkeypatch.undo()
    data.write_text(json.dumps(second) + "\n")
    alone = run_task("multiple_choice", model, cfg, str(data), [1, 2], str(tmp_path / "s.json"),
                     "x")
    assert partial["results"] == alone and alone[0]["examples"] == 1


# --------------------------------------------------------------------------- as a user runs it


def _eval_command(export, data, out, *extra):
    return ["scse-eval", "--checkpoint", export, "--task", "lambada", "--data", data,
            "--depths", "1,2", "--batch-size", "2", "--out", str(out), *extra]


@pytest.mark.slow
def test_scse_eval_progress_lines_and_ctrl_c(export, tmp_path, user_env):
    """A real process with stderr to a pipe: periodic progress lines, then SIGINT: exit 130,
    one line of how far it got and no traceback, the partial results written."""
    data = _lambada_file(tmp_path / "l.jsonl", _passages(3000, seed=2))
    out = tmp_path / "r.json"
    env = dict(user_env, SCSE_PROGRESS_EVERY_S="0")
    proc = subprocess.Popen(_eval_command(export, data, out), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    lines = []
    for line in proc.stderr:  # a line per batch: stop after the third
        lines.append(line)
        if line.startswith("lambada T=1,2: 6/3000 passage"):
            proc.send_signal(signal.SIGINT)
            break
    err = "".join(lines) + proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert re.match(r"lambada T=1,2: 2/3000 passage, [\d.]+ passage/s, elapsed \d+:\d\d, "
                    r"ETA \d+:\d\d", lines[0]), lines[0]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"scse-eval: interrupted: lambada: (\d+)/3000 passages scored \(all "
                         rf"depths in one pass\); partial results in {re.escape(str(out))}", last)
    assert match, err
    partial = json.loads(out.read_text())
    assert partial["partial"]["done"] == int(match.group(1)) >= 6
    assert partial["results"][0]["examples"] == int(match.group(1))


@pytest.mark.slow
def test_scse_eval_shows_a_bar_on_a_terminal(export, tmp_path, user_env):
    """stderr a terminal (a pty of 24 x 120, as a terminal window has a size): tqdm's bar,
    ending at 100% with the passage count."""
    data = _lambada_file(tmp_path / "l.jsonl", _passages(10, seed=3))
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(_eval_command(export, data, tmp_path / "r.json"), env=user_env,
                            stdout=subprocess.DEVNULL, stderr=secondary)
    os.close(secondary)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(primary)
    assert proc.wait(timeout=60) == 0
    text = seen.decode(errors="replace")
    assert re.search(r"lambada T=1,2: 100%\|[^\r\n]*\| 10/10 ", text), text
