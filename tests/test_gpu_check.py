"""benchmarks/gpu_check.py: its --cpu twin end to end (so the GPU check cannot rot), and its
steady-state averaging and pass/fail rules."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# Trains at two ZeRO stages in subprocesses (about 45 s): the slow tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_cpu_check_trains_both_stages_and_writes_the_summary(tmp_path, tiny_data, subprocess_env):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu",
                           "--workdir", str(tmp_path),
                           "--data", str(Path(tiny_data["path"]).parent),
                           "--out", str(out)],
                          env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK" in proc.stdout
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["failures"] == [] and summary["compile"] is False
    assert "model.activation_checkpointing=loop" in summary["overrides"]
    assert "wandb.enabled=false" in summary["overrides"]
    runs = {r["stage"]: r for r in summary["runs"]}
    assert sorted(runs) == [1, 3]
    for r in runs.values():
        assert r["skipped_steps"] == 0 and r["peak_mem_gib"] is None  # no CUDA: no peak memory
        assert r["loop_checkpointing"] is True and r["compile"] is False  # as the trainer ran
        assert [w["step"] for w in r["windows"]] == [1, 2, 4, 6]
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        # on CPU no MFU unless SCSE_PEAK_FLOPS names a peak (docs/training.md)
        assert r["mfu"] is None
        assert r["averaged_steps"] == "3-6"  # 6 steps logged every 2: the first window of 2 is out
        assert r["last_loss"] < r["first_loss"] - gpu_check.CPU.min_loss_drop
        assert sorted(r["ppl"], key=int) == ["1", "4", "32"]
        assert all(math.isfinite(p) and p > 1 for p in r["ppl"].values())
    # One fp32 rank: ZeRO-3's partitioning does not change the arithmetic of the same steps.
    assert runs[3]["first_loss"] == pytest.approx(runs[1]["first_loss"], abs=1e-5)
    assert runs[3]["last_loss"] == pytest.approx(runs[1]["last_loss"], abs=1e-4)


def row(step, tokens_per_s, step_time_s, mfu=0.5):
    return {"step": step, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s, "mfu": mfu}


def test_steady_state_skips_warm_up_windows_and_weights_by_time():
    # windows: [1] compile, [2-5], [6-10]: 4 steps at 1 s with 100 tok/s and 5 steps at 2 s with 50
    rows = [row(1, 1.0, 60.0, 0.01), row(5, 100.0, 1.0, 0.4), row(10, 50.0, 2.0, 0.2)]
    tokens_per_s, mfu, steps = gpu_check.steady_state(rows, warm_steps=1)
    assert steps == "2-10"
    assert tokens_per_s == pytest.approx((100 * 4 + 50 * 10) / 14)
    assert mfu == pytest.approx((0.4 * 4 + 0.2 * 10) / 14)
    assert gpu_check.steady_state(rows, warm_steps=5)[2] == "6-10"
    assert gpu_check.steady_state(rows, warm_steps=50)[2] == "6-10"  # too late: the last window


def test_check_names_the_first_failing_rule():
    ok = {"stage": 3, "first_loss": 10.4, "last_loss": 7.0, "skipped_steps": 0,
          "ppl": {"1": 900.0, "4": 800.0, "32": 790.0}}
    assert gpu_check.check(ok, min_loss_drop=1.0) is None
    assert gpu_check.check({**ok, "skipped_steps": 2}, 1.0) == \
        "ZeRO-3: 2 non-finite step(s) skipped"
    assert gpu_check.check({**ok, "last_loss": 9.9}, 1.0) == \
        "ZeRO-3: loss 10.400 -> 9.900 did not fall by 1.0 nats"
    assert "did not fall" in gpu_check.check({**ok, "last_loss": float("nan")}, 1.0)
    assert "perplexity not finite" in gpu_check.check({**ok, "ppl": {"1": None}}, 1.0)
    assert gpu_check.check({"stage": 1, "failure": "ZeRO-1: trainer exited with 3"}, 1.0) == \
        "ZeRO-1: trainer exited with 3"
