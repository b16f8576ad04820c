"""TensorBoard beside metrics.jsonl: the same numbers under grouped tags, a resumed run's restart
marker, the missing package as one line; and a real run with TensorBoard and the profiler on."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

from scse_dist.config import load_config
from scse_dist.train.depth import sample_depth
from scse_dist.train.metrics import MetricsLogger
from scse_dist.train.metrics_config import WandbConfig
from scse_dist.train.tensorboard import check_tensorboard
from scse_dist.typed_yaml import ConfigError
from train_procs import read_metrics, run_trainer

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

OFF = WandbConfig(enabled=False)


def f32(x: float) -> float:
    """TensorBoard keeps scalars as float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def event_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the event files should hold for metrics.jsonl's rows: every number, tagged train/<key>
    (training rows), eval/<key> (kind eval), sample/<key>; diag/ keys as they are."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        group = {None: "train", "eval": "eval", "sample": "sample"}[row.get("kind")]
        for key, value in row.items():
            if key in ("step", "kind") or isinstance(value, (bool, str, list)) or value is None:
                continue
            tag = key if key.startswith("diag/") else f"{group}/{key}"
            out.setdefault(tag, []).append((row["step"], f32(value)))
    return out


TRAIN_ROW = {"step": 5, "loss": 5.25, "lr": 1e-3, "depth": 3, "tokens_per_s": 1234.5, "mfu": None,
             "step_time_s": 0.05, "tokens": 500, "skipped_steps": 0, "data_failures": 0,
             "diag/D_kept": 0.75, "diag/D_norm_t0": 12.5}


def test_every_row_of_metrics_jsonl_is_in_tensorboard_under_its_group(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), True, OFF, "r", {}, tmp_path / "tb", 0)
    logger.log(TRAIN_ROW)
    # diagnostics off a log step
    logger.log({"step": 7, "diag/D_kept": 0.5, "diag/loop_gain": 0.125})
    logger.write({"step": 10, "kind": "eval", "task": "heldout", "heldout_loss_T1": 6.5,
                  "heldout_loss_T4": 2.5, "tokens": 4096, "eval_time_s": 1.5})
    logger.write({"step": 10, "kind": "sample", "depth": 4, "temperature": 0.8,
                  "samples": [{"prompt": "The", "text": " cat | dog"}]})
    logger.close()
    got = event_scalars(tmp_path / "tb")
    assert got == expected_scalars(read_metrics(tmp_path))
    assert got["train/loss"] == [(5, 5.25)] and got["eval/heldout_loss_T4"] == [(10, 2.5)]
    assert got["diag/D_kept"] == [(5, 0.75), (7, 0.5)]
    assert "train/mfu" not in got and "eval/task" not in got  # null and text values: left out
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("sample/text/text_summary")[0]
    assert text.step == 10
    assert text.tensor_proto.string_val[0].decode() == \
        "| prompt | text |\n|---|---|\n| The |  cat \\| dog |"
    assert f"tensorboard: {tmp_path / 'tb'}" in capsys.readouterr().out


def test_rows_are_flushed_as_they_are_written(tmp_path):
    logger = MetricsLogger(str(tmp_path), True, OFF, "r", {}, tmp_path / "tb", 0)
    logger.log(TRAIN_ROW)
    assert event_scalars(tmp_path / "tb")["train/loss"] == [(5, 5.25)]  # before close
    logger.close()


def test_a_resumed_run_hides_what_the_dead_run_wrote_past_the_checkpoint(tmp_path):
    """A run wrote steps 1..20 and died; the resumed one (from checkpoint step 10) rewrites 11..15:
    TensorBoard shows 1..10 of the first and 11..15 of the second, nothing of the dead 16..20."""
    first = MetricsLogger(str(tmp_path), True, OFF, "r", {}, tmp_path / "tb", 0)
    for step in range(1, 21):
        first.log({**TRAIN_ROW, "step": step, "loss": float(step)})
    first.close()
    second = MetricsLogger(str(tmp_path), True, OFF, "r", {}, tmp_path / "tb", 10)
    for step in range(11, 16):
        second.log({**TRAIN_ROW, "step": step, "loss": 100.0 + step})
    second.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2  # nothing rewritten
    assert event_scalars(tmp_path / "tb")["train/loss"] == \
        [(s, float(s)) for s in range(1, 11)] + [(s, 100.0 + s) for s in range(11, 16)]


def test_tensorboard_without_the_package_is_one_config_error(tmp_path, monkeypatch, capsys,
                                                             tiny_config):
    from scse_dist.train.cli import main

    line = ("tensorboard.enabled: the tensorboard package is not installed; pip install "
            "'scse-dist[tensorboard]' (or tensorboard), or set tensorboard.enabled: false")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = load_config(tiny_config(tmp_path), ["tensorboard.enabled=true"])
    with pytest.raises(ConfigError) as err:
        check_tensorboard(cfg.tensorboard)
    assert str(err.value) == line
    check_tensorboard(load_config(tiny_config(tmp_path)).tensorboard)  # off: no check
    with pytest.raises(ConfigError) as err:  # train() called directly: the same line
        MetricsLogger(str(tmp_path), True, OFF, "r", {}, tmp_path / "tb", 0)
    assert str(err.value) == line
    assert main(["--config", tiny_config(tmp_path), "tensorboard.enabled=true"]) == 2
    assert capsys.readouterr().err == f"scse-train: config error: {line}\n"
    assert not (tmp_path / "runs").exists()  # nothing started


def test_log_dir_must_be_local():
    with pytest.raises(ConfigError, match="^tensorboard.log_dir: a local directory"):
        load_config(None, ["tensorboard.log_dir=s3://bucket/tb"])


@pytest.mark.slow
def test_a_run_with_tensorboard_and_the_profiler_then_a_resume_from_an_earlier_checkpoint(
        tmp_path, tiny_config, subprocess_env):
    """TensorBoard holds metrics.jsonl's numbers (training, eval and diagnostics rows), also after
    a resume that rewrites steps 11..20; the profiler writes a Chrome trace of steps 3..4 with the
    model's loop-step labels, and a resumed run past the window profiles nothing."""
    config = tiny_config(tmp_path, "tensorboard.enabled=true", "eval.every_steps=5",
                         "train.diagnostics_every=2", "profile.enabled=true",
                         "profile.start_step=3", "profile.steps=2",
                         "model.activation_checkpointing=loop")
    run_dir = tmp_path / "runs" / "tiny"
    out = run_trainer(config, subprocess_env)
    rows = read_metrics(run_dir)
    assert {r.get("kind") for r in rows} == {None, "eval"}
    assert any("diag/D_kept" in r and "loss" not in r for r in rows)  # a diagnostics-only row
    got = event_scalars(run_dir / "tensorboard")
    assert got == expected_scalars(rows)
    assert [s for s, _ in got["train/loss"]] == [1, 5, 10, 15, 20]
    assert [s for s, _ in got["eval/heldout_loss_T2"]] == [5, 10, 15, 20]

    trace_path = run_dir / "profile" / "rank0.steps3-4.pt.trace.json"
    assert f"profile: steps 3..4 of rank 0 in {trace_path}" in out
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == \
        ["rank0.steps3-4.pt.trace.json", "rank0.steps3-4.txt"]
    events = json.loads(trace_path.read_text())["traceEvents"]  # Chrome's trace format
    spans = [e["name"] for e in events if e.get("ph") == "X"]
    assert sorted({n for n in spans if n.startswith("ProfilerStep#")}) == \
        ["ProfilerStep#3", "ProfilerStep#4"]
    # Each training step's forward labels its T loop steps, and with loop checkpointing the
    # backward's recomputation of each again (the diagnostics' pass steps the core itself).
    cfg = load_config(config)
    depths = [sample_depth(step - 1, cfg.train.depth, cfg.model.depth, cfg.train.seed)
              for step in (3, 4)]
    for suffix in ("", "_recompute"):
        labels = sorted(n for n in spans if re.fullmatch(rf"loop_step_\d+{suffix}", n))
        assert labels == sorted(f"loop_step_{t}{suffix}" for d in depths for t in range(d))

    # From checkpoint step 10 again: metrics.jsonl is cut at 10 and TensorBoard hides 11..20 of
    # the first run behind the new ones.
    first = {tag: dict(points) for tag, points in got.items()}
    out = run_trainer(config, subprocess_env, "train.start.resume_from=step-10",
                      "train.optimizer.lr=6e-3")
    assert "profile: steps 3..4 were done before this run resumed at step 10: nothing profiled" \
        in out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 5, 10, 11, 15, 20]
    got = event_scalars(run_dir / "tensorboard")
    assert got == expected_scalars(rows)
    assert got["train/loss"][:3] == [(s, first["train/loss"][s]) for s in (1, 5, 10)]
    assert got["train/loss"][4][1] != first["train/loss"][15]  # the resumed run's, at lr 6e-3


def test_a_fresh_start_moves_the_old_event_files_and_traces_aside_with_the_rest(tmp_path):
    from scse_dist.checkpoint.resume import _move_previous_run

    for name in ("tensorboard", "profile", "checkpoints"):
        (tmp_path / name).mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    (tmp_path / "metrics.jsonl").write_text("")
    aside = _move_previous_run(tmp_path)
    assert sorted(p.name for p in aside.iterdir()) == \
        ["checkpoints", "metrics.jsonl", "profile", "tensorboard"]
    assert (aside / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
