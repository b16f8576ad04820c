"""benchmarks/plot_collapse.py: it plots the diagnostics rows of metrics.jsonl (only those up to
--until) and a run without them is one line."""

from __future__ import annotations

import json
import subprocess
import sys

from train_procs import REPO

SCRIPT = str(REPO / "benchmarks" / "plot_collapse.py")


def _run(tmp_path, steps):
    run = tmp_path / "run-a"
    run.mkdir()
    rows = [{"step": s, "loss": 7.0} for s in range(1, 31)]  # training rows carry no diag/
    rows += [{"step": s, "diag/D_kept": 1.0 / s, "diag/jacobian_gain_D0": 0.5,
              "diag/anchor_over_scale": 1.0 + s / 100, "diag/branch_attn_b0": 0.01 * s,
              "diag/branch_mlp_b0": 0.02 * s, "diag/update_ratio_core_mlp": 0.1 / s,
              "diag/update_ratio_norm": 0.001} for s in steps]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_plot_is_written_from_the_diagnostics_rows(tmp_path):
    run = _run(tmp_path, [10, 20, 30])
    out = tmp_path / "collapse.png"
    done = subprocess.run([sys.executable, SCRIPT, "--run", str(run), "--out", str(out),
                           "--until", "20"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_torn_last_line_is_skipped(tmp_path):
    """metrics.jsonl is read through RunDir: a run killed mid-write still plots."""
    import importlib.util

    run = _run(tmp_path, [10, 20])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 30, "diag/D_kept": 0.0')
    spec = importlib.util.spec_from_file_location("plot_collapse", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [r["step"] for r in module.diag_rows(run, 10**9)] == [10, 20]


def test_a_run_without_diagnostics_is_one_line(tmp_path):
    run = _run(tmp_path, [])
    done = subprocess.run([sys.executable, SCRIPT, "--run", str(run), "--out",
                           str(tmp_path / "x.png")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"plot_collapse: {run}/metrics.jsonl: no loop diagnostics "
                                   "rows (the diagnostics callback off?)")
    assert not (tmp_path / "x.png").exists()


def test_rows_past_until_are_left_out(tmp_path):
    run = _run(tmp_path, [10, 20])
    done = subprocess.run([sys.executable, SCRIPT, "--run", str(run), "--out",
                           str(tmp_path / "x.png"), "--until", "5"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and "no loop diagnostics rows" in done.stderr
