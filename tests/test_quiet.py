"""Third-party noise is quiet by default and shown with SCSE_VERBOSE=1 (what -v sets): wandb's
run footer, held zero_to_fp32 output replayed when the block fails (scse_dist.quiet)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scse_dist.quiet import quiet_output

FOOTER_RUN = """
from scse_dist.train.metrics import MetricsLogger
from scse_dist.train.metrics_config import WandbConfig

logger = MetricsLogger({run_dir!r}, True, WandbConfig(enabled=True, mode="offline"), "quiet",
                       {{"a": 1}})
for step in range(3):
    logger.log({{"step": step, "loss": 1.0 / (step + 1), "lr": 1e-3, "depth": 2,
                "tokens_per_s": 100.0, "step_time_s": 0.1}})
logger.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("verbose", ["0", "1"])
def test_wandb_footer_only_when_verbose(tmp_path, user_env, verbose):
    proc = subprocess.run([sys.executable, "-c", FOOTER_RUN.format(run_dir=str(tmp_path))],
                          capture_output=True, text=True, timeout=240,
                          env=dict(user_env, SCSE_VERBOSE=verbose))
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert ("Run history:" in output) == (verbose == "1"), output
    assert "Run data is saved locally in" in output  # where the run went: always said


def test_held_output_is_dropped_on_success_and_replayed_on_failure(capsys, monkeypatch):
    monkeypatch.delenv("SCSE_VERBOSE", raising=False)
    with quiet_output():
        print("Processing zero checkpoint")
    assert capsys.readouterr() == ("", "")
    with pytest.raises(RuntimeError), quiet_output():
        print("Detected checkpoint of type zero stage 1")
        raise RuntimeError("broken partition")
    assert capsys.readouterr() == ("", "Detected checkpoint of type zero stage 1\n")
    monkeypatch.setenv("SCSE_VERBOSE", "1")
    with quiet_output():
        print("Reconstructed fp32 state dict")
    assert capsys.readouterr().out == "Reconstructed fp32 state dict\n"


def test_other_threads_output_is_not_held(capsys, monkeypatch):
    # e.g. the checkpoint upload thread reporting a failure while the export consolidates
    import threading

    monkeypatch.delenv("SCSE_VERBOSE", raising=False)
    with quiet_output():
        print("Loading checkpoint shards")
        other = threading.Thread(target=print, args=("upload of step-0000040 failed",))
        other.start()
        other.join()
    assert capsys.readouterr() == ("upload of step-0000040 failed\n", "")
