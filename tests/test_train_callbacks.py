"""The trainer's callbacks: evaluation during training, metrics.jsonl cut at a resume, eval rows
kept apart from training rows for their readers."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from scse_dist.train.callbacks.heldout_eval import agreed_batches, reduce_rows
from scse_dist.train.metrics import MetricsLogger, cut_metrics
from scse_dist.train.metrics_config import WandbConfig
from train_procs import REPO, TRAIN, all_passed, read_metrics, run_trainer, train_ranks

TIMING = ("tokens_per_s", "mfu", "step_time_s")


def write_rows(path: Path, rows: list[dict], torn: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def test_cut_metrics_drops_rows_past_the_step_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 5, "loss": 3.0}, {"step": 10, "loss": 2.0}, {"step": 10, "kind": "eval"},
            {"step": 15, "loss": 1.5}, {"step": 20, "kind": "eval"}]
    write_rows(path, rows, torn='{"step": 25, "lo')
    assert cut_metrics(path, 10) == 3
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:3]
    assert cut_metrics(path, 10) == 0  # nothing past: the file is left as it is
    assert cut_metrics(tmp_path / "absent.jsonl", 0) == 0
    assert cut_metrics(path, 0) == 3 and path.read_text() == ""  # a fresh start keeps nothing


def test_a_continuation_keeps_its_leading_space(tiny_data):
    from scse_dist.data.tokenizer import Tokenizer
    from scse_dist.generate.text import continuation_text

    tok = Tokenizer.load(tiny_data["tokenizer"])
    prompt, whole = tok.encode("The cat"), tok.encode("The cat sees the red ball")
    assert whole[:len(prompt)] == prompt  # the prompt's pieces, then the continuation's
    new = whole[len(prompt):] + [tok.eos_id]
    assert tok.decode(new).startswith("sees")  # decoded alone, the space is lost
    assert continuation_text(tok, prompt, new) == " sees the red ball"


def test_agreed_batches_stop_at_the_limit_or_when_the_batches_run_out():
    batches = [torch.full((2, 3), i) for i in range(5)]
    assert len(list(agreed_batches(iter(batches), 3, torch.device("cpu")))) == 3
    assert len(list(agreed_batches(iter(batches), 0, torch.device("cpu")))) == 5
    assert len(list(agreed_batches(iter(batches), 9, torch.device("cpu")))) == 5


@pytest.mark.parametrize("recurrence", ["scse", "untied"])
def test_forward_rows_equal_the_evaluation_scorer(recurrence):
    from scse_dist.eval.perplexity import evaluate_heldout
    from scse_dist.model import LoopedLM
    from scse_dist.model.config import ModelConfig
    from scse_dist.train.callbacks.heldout_eval import forward_rows

    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=16,
                                 recurrence=recurrence, depth=2))
    batches = [torch.randint(0, 64, (3, 17)) for _ in range(2)]
    depths = [2] if recurrence == "untied" else [1, 2, 4]
    want = evaluate_heldout(model, iter(batches), depths)
    got = forward_rows(model, iter(batches), depths)
    assert [(r["depth"], r["tokens"]) for r in got] == [(r["depth"], r["tokens"]) for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert model.training  # restored


def test_reduce_rows_weights_each_depth_by_tokens_in_one_process():
    rows = [{"depth": 1, "loss": 2.0, "ppl": 7.39, "tokens": 100},
            {"depth": 4, "loss": 1.0, "ppl": 2.72, "tokens": 100}]
    got = reduce_rows(rows, torch.device("cpu"))
    assert [(r["depth"], r["tokens"]) for r in got] == [(1, 100), (4, 100)]
    assert [r["loss"] for r in got] == pytest.approx([2.0, 1.0], rel=1e-12)
    assert got[0]["ppl"] == pytest.approx(torch.tensor(2.0).exp().item())


def test_eval_rows_go_to_the_file_and_wandb_but_not_the_console(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(str(tmp_path), True, WandbConfig(enabled=True, mode="offline"), "t", {})
    logger.write({"step": 10, "kind": "eval", "task": "heldout", "heldout_loss_T4": 2.5})
    logger.write({"step": 10, "kind": "sample", "depth": 4, "temperature": 0.8,
                  "samples": [{"prompt": "Return the", "text": " value of x"}]})
    logger.close()
    assert capsys.readouterr().out == ""
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["heldout_loss_T4"] == 2.5
    assert json.loads(lines[1])["samples"] == [{"prompt": "Return the", "text": " value of x"}]
    table = next((tmp_path / "wandb").rglob("samples_*.table.json"))  # the samples as a table
    assert json.loads(table.read_text())["data"] == [["Return the", " value of x"]]
    run = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    # wandb's service process may still be writing the file when finish() returns: wait for it.
    deadline = time.monotonic() + 60
    while b"heldout_loss_T4" not in run.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"heldout_loss_T4" in run.read_bytes()


@pytest.mark.slow
def test_eval_during_training_leaves_training_alone_and_matches_the_final_eval(
        tmp_path, tiny_config, subprocess_env):
    for name in ("plain", "eval"):
        (tmp_path / name).mkdir()
    plain = tiny_config(tmp_path / "plain")
    with_eval = tiny_config(tmp_path / "eval", "eval.every_steps=10", "eval.after_train=true",
                            "eval.sample_every=10", "eval.sample_tokens=5")
    run_trainer(plain, subprocess_env)
    stdout = run_trainer(with_eval, subprocess_env)
    reference = read_metrics(tmp_path / "plain" / "runs" / "tiny")
    rows = read_metrics(tmp_path / "eval" / "runs" / "tiny")
    train_rows = [r for r in rows if "kind" not in r]
    drop = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    # the same seed gives bit-identical training rows with and without evaluation in between
    assert [drop(r) for r in train_rows] == [drop(r) for r in reference]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [10, 20]
    samples = [r for r in rows if r.get("kind") == "sample"]
    assert [r["step"] for r in samples] == [10, 20]
    assert [s["prompt"] for s in samples[0]["samples"]] == \
        ["The", "Return the", "This module provides"]
    assert all(s["text"] for r in samples for s in r["samples"])
    assert samples[0]["depth"] == 2 and samples[0]["temperature"] == 0.8
    assert "sample step     20 | 'Return the' -> " in stdout
    rows = [r for r in rows if r.get("kind") != "sample"]
    assert set(evals[0]) == {"step", "kind", "task", "heldout_loss_T1", "heldout_ppl_T1",
                             "heldout_loss_T2", "heldout_ppl_T2", "tokens", "eval_time_s"}
    # each eval row follows the training row of its step
    assert [r["step"] for r in rows] == [1, 5, 10, 10, 15, 20, 20]
    assert evals[1]["heldout_loss_T2"] < evals[0]["heldout_loss_T2"]
    assert evals[0]["tokens"] == 2 * 4 * 32  # eval.max_batches=2 of eval.batch_size=4 x seq_len
    final = json.loads((tmp_path / "eval" / "runs" / "tiny" / "eval" / "heldout.json").read_text())
    # at world size 1 the last row is the after-training evaluation of the export, exactly
    assert {r["depth"]: r["loss"] for r in final["results"]} == {
        1: evals[1]["heldout_loss_T1"], 2: evals[1]["heldout_loss_T2"]}
    assert "eval step     20 | heldout loss T1 " in stdout
    # the console line has elapsed time and ETA (console only: the rows' keys are unchanged);
    # each save says so with its time
    last = next(line for line in stdout.splitlines() if line.startswith("step     20 |"))
    assert re.search(r"\| elapsed \d+:\d\d \| ETA 0:00$", last), last
    assert re.search(r"^saved checkpoint step-0000010 \(\d+\.\d s\)$", stdout, re.M)


@pytest.mark.slow
def test_eval_during_training_on_two_ranks_under_zero3(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path, "train.engine.zero_stage=3", "train.max_steps=4",
                      "eval.every_steps=2",
                      "eval.max_batches=3", "train.log_every=2", "train.checkpoint.every=4")
    all_passed(train_ranks(cfg, subprocess_env))
    evals = [r for r in read_metrics(tmp_path / "runs" / "tiny") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    # max_batches=3 over 2 ranks: 2 batches each, every rank's tokens summed
    assert all(r["tokens"] == 2 * 2 * 4 * 32 for r in evals)
    assert all(0 < r["heldout_loss_T1"] < 10 and 0 < r["heldout_loss_T2"] < 10 for r in evals)


@pytest.mark.slow
def test_too_many_bad_samples_mid_training_is_one_line_exit_65_and_the_checkpoint_intact(
        tmp_path, tiny_data, tiny_config, subprocess_env):
    import shutil
    import subprocess

    from scse_dist.checkpoint.manifest import verify_tag

    shards = tmp_path / "shards"
    shutil.copytree(tiny_data["path"], shards)
    config = tiny_config(tmp_path, f"data.path={shards}", "train.max_steps=10",
                         "train.checkpoint.every=10")
    run_trainer(config, subprocess_env)
    # the shards go bad under the finished run; the continuation reads them
    for entry in json.loads((shards / "index.json").read_text())["splits"]["train"]:
        tar = shards / entry["url"]
        data = bytearray(tar.read_bytes())
        for at in [i for i in range(len(data)) if data.startswith(b"\x93NUMPY", i)]:
            data[at:at + 6] = b"garbag"  # np.load fails on every sample
        tar.write_bytes(bytes(data))
    out = subprocess.run([sys.executable, TRAIN, "--config", config, "train.max_steps=30",
                          "data.max_failures=0"], cwd=REPO, env=subprocess_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 65, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("scse-train:")]
    assert len(errors) == 1 and "more than data.max_failures=0" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-0000010"
    assert verify_tag(ckpts / "step-0000010").intact
    assert sorted(p.name for p in ckpts.glob("*step-*")) == ["step-0000010"]  # nothing half-saved


@pytest.mark.slow
def test_time_between_steps_is_not_step_time(tmp_path, tiny_config, subprocess_env):
    """tokens_per_s and step_time_s count the optimizer steps, not pauses between them (an
    evaluation, a save; here a 3 s stall before step 3), which the elapsed time does count."""
    config = tiny_config(tmp_path, "train.max_steps=5", "train.log_every=5")
    env = dict(subprocess_env, SCSE_FAULT="stall@3", SCSE_FAULT_STALL_S="3")
    stdout = run_trainer(config, env)
    row = read_metrics(tmp_path / "runs" / "tiny")[-1]
    assert row["step"] == 5 and 4 * row["step_time_s"] < 3.0, row  # steps 2-5, without the stall
    assert re.search(r"^step      5 \|.*\| elapsed 0:0[3-9] \|", stdout, re.M), stdout


@pytest.mark.slow
def test_logged_throughput_counts_the_loop_diagnostics(tmp_path, tiny_config, subprocess_env):
    """Diagnostics (every 10 steps, to T = 16) are training work the run waits on: each window's
    logged tokens/s is the wall-clock rate between its log steps to within 5% (a ratio in one
    run, not a speed)."""
    config = tiny_config(tmp_path, "train.max_steps=31", "train.log_every=10",
                         "train.callbacks.diagnostics.init_args.every_steps=10",
                         "train.checkpoint.every=1000",
                         "train.callbacks.probe={class_path: wall_clock_probe:StepEnds, "
                         f"init_args: {{out: '{tmp_path / 'ends.json'}'}}}}")
    run_trainer(config, dict(subprocess_env, PYTHONPATH=f"{REPO}:{REPO / 'tests'}"))
    ends = {int(k): v for k, v in json.loads((tmp_path / "ends.json").read_text()).items()}
    rows = {r["step"]: r for r in read_metrics(tmp_path / "runs" / "tiny") if "loss" in r}
    assert "diag/D_kept" in rows[20]  # the diagnostics ran in the windows measured
    for start, end in ((10, 20), (20, 30)):
        wall_rate = rows[end]["tokens"] - rows[start]["tokens"]
        wall_rate /= ends[end] - ends[start]
        assert rows[end]["tokens_per_s"] / wall_rate == pytest.approx(1.0, abs=0.05), (start, end)


def test_a_second_ctrl_c_during_the_first_ones_line_exits_at_once(monkeypatch):
    """The first Ctrl-C's flag is set before its line is written: a second one landing during the
    write (seen on the loaded test machine) exits 130 instead of starting over."""
    import signal

    from scse_dist.train.faults import PreemptionFlag

    flag = PreemptionFlag()  # not installed: its handler is called directly
    exits, said = [], []

    def exit_now(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)  # os._exit does not return

    monkeypatch.setattr("os._exit", exit_now)

    def say(line: bytes) -> None:
        said.append(line)
        if len(said) == 1:  # the second Ctrl-C arrives while the first is being reported
            flag._handle(signal.SIGINT, None)

    flag._say = say
    with pytest.raises(SystemExit):
        flag._handle(signal.SIGINT, None)
    assert exits == [130] and flag.signal_name == "SIGINT"
    assert [line.split(b":")[1] for line in said] == [b" Ctrl-C", b" interrupted again"]
    other = PreemptionFlag()  # SIGTERM first: a Ctrl-C after it is a first Ctrl-C, no exit
    other._say = said.append
    other._handle(signal.SIGTERM, None)
    other._handle(signal.SIGINT, None)
    assert other.signal_name == "SIGTERM" and exits == [130]
