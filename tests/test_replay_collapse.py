"""benchmarks/replay_collapse.py: what each way freezes, and on a tiny run (20 training steps, so
the slow tier) that the frozen control holds D, moving replays the run's own diagnostics, and a
missing checkpoint is one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from train_procs import REPO, read_metrics, run_trainer

SCRIPT = str(REPO / "benchmarks" / "replay_collapse.py")


def _script():
    spec = importlib.util.spec_from_file_location("replay_collapse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_each_way_holds_still() -> None:
    from scse_dist.model import LoopedLM
    from scse_dist.model.config import ModelConfig

    names = [n for n, _ in LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2,
                                                inject="concat")).named_parameters()]
    held = {way: {n for n in names if _script().frozen_names(way)(n)} for way in _script().WAYS}
    assert held["moving"] == held["half_lr"] == set() and held["all_frozen"] == set(names)
    assert held["anchor"] == {"core.anchor.weight"}
    assert "core.adapter.weight" in held["core"] and "core.blocks.0.norm2.weight" in held["core"]
    assert "core.anchor.weight" not in held["core"] and "norm.weight" in held["norms"]
    assert all(n.endswith("norm1.weight") or n.endswith("norm2.weight") or n == "norm.weight"
               for n in held["norms"])


def test_logged_rows_read_through_run_dir_past_a_torn_last_line(tmp_path) -> None:
    rows = [{"step": 10, "loss": 5.0, "diag/D_norm_t0": 1.0, "diag/D_norm_t8": 0.5},
            {"step": 10, "kind": "eval", "ppl_t4": 300.0},
            {"step": 20, "loss": 4.0, "diag/D_norm_t0": 1.0, "diag/D_norm_t8": 0.25}]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 30, "loss": 3.')  # killed mid-write
    assert _script().logged_rows(tmp_path) == {10: {"D_norm_t0": 1.0, "D_norm_t8": 0.5},
                                               20: {"D_norm_t0": 1.0, "D_norm_t8": 0.25}}


@pytest.mark.slow
def test_replay_ways_from_a_checkpoint(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path)  # 20 steps, checkpoints at 10 and 20, diagnostics every 5
    run_trainer(cfg, subprocess_env)
    run_dir = tmp_path / "runs" / "tiny"
    logged = {r["step"]: r for r in read_metrics(run_dir) if "diag/D_kept" in r}
    out = subprocess.run([sys.executable, SCRIPT, "--run", str(run_dir), "--from-step", "10",
                          "--steps", "5", "--ways", "moving,anchor,all_frozen",
                          "--keys", "D_kept,loss", "--json", str(tmp_path / "replay.json")],
                         cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "replay.json").read_text())
    assert [r["step"] for r in rows["moving"]] == [11, 12, 13, 14, 15]
    # everything frozen: the checkpoint's weights at every step, D_kept as logged at step 10
    frozen = [r["D_kept"] for r in rows["all_frozen"]]
    assert frozen == [frozen[0]] * 5
    assert frozen[0] == pytest.approx(logged[10]["diag/D_kept"], rel=1e-6)
    # everything moving replays the run itself (its data, depths, optimizer state)
    assert rows["moving"][-1]["D_kept"] == pytest.approx(logged[15]["diag/D_kept"], rel=1e-5)
    assert rows["moving"][-1]["jacobian_norm"] == pytest.approx(
        logged[15]["diag/jacobian_norm"], rel=1e-5)
    assert rows["anchor"][-1]["D_kept"] != rows["moving"][-1]["D_kept"]
    assert "D_kept after each replayed step" in out.stdout
    assert "15 | " in out.stdout and "loss after each replayed step" in out.stdout

    missing = subprocess.run([sys.executable, SCRIPT, "--run", str(run_dir), "--from-step", "7"],
                             cwd=REPO, env=subprocess_env, capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"--from-step: {run_dir} has no checkpoint step-0000007 "
                                      "(its tags: step-0000010, step-0000020)")
