"""SIGKILL anywhere in a run, then a rerun of the same command: the run finishes as if nothing had
happened. One tiny single-process run is killed at K random steps (seeded), in the middle of its
final checkpoint write and in the middle of its export (SCSE_FAULT kill, kill_in_save,
kill_in_export: scse_dist/train/faults.py); each rerun resumes from the newest committed
checkpoint. At the end its metrics hold each step once, in order, and its export is byte-identical
to an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import pytest

from scse_dist.run_lock import LOCK_NAME
from train_procs import REPO, TRAIN, read_metrics, run_trainer

pytestmark = pytest.mark.slow

STEPS = 12
OVERRIDES = (f"train.max_steps={STEPS}", "train.checkpoint.every=4", "train.log_every=1")
KILLS = 3
SEED = 38


def killed_at(config: str, env: dict, fault: str) -> str:
    """Run the trainer with SCSE_FAULT=fault and check that the fault's SIGKILL ended it; its
    stderr."""
    out = subprocess.run([sys.executable, TRAIN, "--config", config], cwd=REPO, text=True,
                         env=dict(env, SCSE_FAULT=fault), capture_output=True, timeout=300)
    assert out.returncode == -9, f"{fault}: rc {out.returncode}\n{out.stderr[-3000:]}"
    return out.stderr


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sigkill_at_random_steps_in_a_save_and_in_the_export_then_a_clean_finish(
        tmp_path, tiny_config, subprocess_env):
    for name in ("reference", "killed"):
        (tmp_path / name).mkdir()
    run_trainer(tiny_config(tmp_path / "reference", *OVERRIDES), subprocess_env)
    want = sha256(tmp_path / "reference" / "runs" / "tiny" / "export" / "model.safetensors")

    config = tiny_config(tmp_path / "killed", *OVERRIDES)
    run_dir = tmp_path / "killed" / "runs" / "tiny"
    ckpts, export = run_dir / "checkpoints", run_dir / "export"
    # increasing steps, so each rerun (resumed at or before the last kill) reaches the next one
    kills = sorted(random.Random(SEED).sample(range(2, STEPS), KILLS))
    for i, step in enumerate(kills):
        stderr = killed_at(config, subprocess_env, f"kill@{step}")
        assert max(r["step"] for r in read_metrics(run_dir)) == step - 1
        # the killed run's lock stays; the next start takes it over (its pid is gone), one line
        assert (run_dir / LOCK_NAME).is_file()
        assert ("took over a stale lock" in stderr) == (i > 0), stderr[-3000:]
    committed = (ckpts / "latest").read_text()
    killed_at(config, subprocess_env, f"kill_in_save@{STEPS}")
    assert (ckpts / "latest").read_text() == committed  # the half-written save is not named
    assert (ckpts / f".tmp-step-{STEPS:07d}").is_dir()
    killed_at(config, subprocess_env, f"kill_in_export@{STEPS}")
    assert (ckpts / "latest").read_text() == f"step-{STEPS:07d}"
    # the export is written beside its folder and moved in whole: a kill leaves no half of one
    assert not export.exists() and len(list(run_dir.glob(".tmp-export.*"))) == 1

    run_trainer(config, subprocess_env)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert sha256(export / "model.safetensors") == want
    assert (export / "config.yaml").is_file()
    assert not list(run_dir.rglob(".tmp-*")) and not (run_dir / LOCK_NAME).exists()
