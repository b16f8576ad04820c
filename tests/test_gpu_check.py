"""benchmarks/gpu_check.py: its --cpu twin end to end (so the GPU check cannot rot), and its
steady-state averaging and failure rules."""

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

# Eight stages, five of them trainer processes: about 4 minutes on a loaded 2-core machine.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)
STAGES = [name for name, _, _ in gpu_check.STAGES]


def test_cpu_check_runs_every_stage_and_writes_the_gpu_runs_keys(tmp_path, tiny_data,
                                                                  subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k != "PYTHONPATH"}  # a user's shell
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu",
                           "--workdir", str(tmp_path / "work"), "--out", str(out),
                           "--data", str(Path(tiny_data["path"]).parent)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == (0 if summary["ok"] else 1), proc.stdout[-3000:] + proc.stderr
    assert sorted(summary) == sorted(gpu_check.SUMMARY_KEYS)
    assert list(summary["stages"]) == STAGES  # in the order
    for name, row in summary["stages"].items():
        assert set(row) == gpu_check.stage_keys(name), name  # what the GPU run writes
        assert row["status"] == "ok", (name, row)
    stages = summary["stages"]
    assert stages["versions"]["cuda"] is None and stages["versions"]["bf16_matmul_tflops"] > 0
    for name in gpu_check.TRAIN_STAGES:
        row = stages[name]
        assert row["steps_logged"] == 4 and row["averaged_steps"] == "2-4", name
        assert row["skipped_steps"] == 0 and row["tokens_per_s"] > 0, name
        assert row["peak_mem_gib"] is None and row["mfu"] is None  # no CUDA, no peak FLOP/s
        assert row["compile"] is name.startswith("compiled")  # as the trainer ran it
        # the config's auto: the toy fits the CPU budget without checkpointing (loop: forced)
        assert row["loop_checkpointing"] is (name == "compiled_loop")
    # one fp32 rank: compiling and ZeRO-3 leave the arithmetic of the same steps alone
    for name in ("compiled_loop", "compiled_none", "zero3"):
        assert stages[name]["last_loss"] == pytest.approx(stages["eager_zero1"]["last_loss"],
                                                          abs=1e-4)
    assert stages["eager_zero1"]["planned_peak_gib"] > 0
    assert stages["eager_zero1"]["planned_micro_batch"] == 2
    assert stages["document_mask"]["tokens_per_s_vs_causal"] == pytest.approx(
        stages["document_mask"]["tokens_per_s"] / stages["eager_zero1"]["tokens_per_s"])
    probes = stages["bug_probes"]
    assert probes["flex_logits_max_abs"] < 1e-5  # aot_eager on CPU: the fp32 rounding only
    assert "does not support backward on CPU" in probes["flex_grad_error"]
    # the finder's probe under autocast either runs (2 sequences) or its error is a failure
    assert (probes["finder_micro_batch"] == 2) is (probes["finder_error"] is None)
    assert any(line.startswith("bug_probes: micro-batch finder") for line in
               summary["failures"]) is (probes["finder_error"] is not None)
    assert stages["generation"]["speculative_equals_greedy"] is True
    assert stages["compiled_loop"]["profile_table"] == "profile.txt"
    assert "ProfilerStep*" in (out / "profile.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == \
        ["gpu_check-files.tar.gz", "profile.txt", "summary.json"]  # under a device's 8 files
    with tarfile.open(out / "gpu_check-files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{name}.log" for name in STAGES} <= names
    assert {f"runs/{name}/metrics.jsonl" for name in gpu_check.TRAIN_STAGES} <= names


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


def test_failures_name_stages_that_did_not_end_and_bugs_that_are_back():
    ok = {"status": "ok", "skipped_steps": 0}
    assert gpu_check.failures_of({"eager_zero1": ok, "bug_probes": {
        "status": "ok", "flex_logits_max_abs": 2e-7, "flex_grad_max_abs": None,
        "finder_error": None}}) == []
    assert gpu_check.failures_of({
        "zero3": {"status": "timeout after 60 s", "skipped_steps": None},
        "compiled_none": {**ok, "skipped_steps": 2},
        "bug_probes": {"status": "ok", "flex_logits_max_abs": 0.06, "flex_grad_max_abs": None,
                       "finder_error": "RuntimeError: expected dtype float"}}) == [
        "zero3: timeout after 60 s",
        "compiled_none: 2 non-finite step(s) skipped",
        "bug_probes: flex_logits_max_abs 0.06 (flex in a compiled block is not SDPA)",
        "bug_probes: micro-batch finder under autocast: RuntimeError: expected dtype float"]


def test_a_stage_that_runs_out_of_time_keeps_its_log_and_what_it_recorded(tmp_path):
    """The child is killed with its process group; the numbers logged before stay."""
    log = tmp_path / "stage.log"
    status = gpu_check.run_child(
        [sys.executable, "-c", "import time; print('measured 1', flush=True); time.sleep(60)"],
        log, timeout=3, env={})
    assert status == "timeout after 3 s" and log.read_text() == "measured 1\n"
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(
        {"step": 2, "loss": 5.0, "skipped_steps": 0, **row(2, 100.0, 0.5, None)}) + "\n")
    measures = gpu_check.train_measures(run, steps=30)
    assert measures["steps_logged"] == 2 and measures["tokens_per_s"] == 100.0
    assert measures["compile"] is None  # no config.yaml: the run had not started its steps
