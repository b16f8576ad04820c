"""train.loss.z_loss and model.qk_norm in real runs: the z-loss changes the updates, not the logged
cross-entropy, and has its own metric; a QK-norm model trains, exports and loads back."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import TINY_VOCAB
from train_procs import REPO, TRAIN, read_metrics

pytestmark = pytest.mark.slow


def train(config: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--config", config], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def training_rows(run_dir):
    return [r for r in read_metrics(run_dir) if "kind" not in r]


def test_z_loss_and_qk_norm_runs(tmp_path, tiny_config, subprocess_env):
    runs = {"plain": (), "z": ("train.loss.z_loss=1e-4",),
            "qk": ("train.loss.z_loss=1e-4", "model.qk_norm=true")}
    rows = {}
    for name, overrides in runs.items():
        (tmp_path / name).mkdir()
        out = train(tiny_config(tmp_path / name, "train.log_every=1", "train.max_steps=12",
                                *overrides), subprocess_env)
        assert out.returncode == 0, out.stderr[-3000:]
        rows[name] = training_rows(tmp_path / name / "runs" / "tiny")
        if name != "plain":
            assert " | z_loss " in out.stdout  # the console line shows the term
    plain, z, qk = rows["plain"], rows["z"], rows["qk"]
    assert all("z_loss" not in r for r in plain)
    # step 1 is the loss of the same initial weights: the logged loss is the cross-entropy alone
    assert z[0]["loss"] == plain[0]["loss"]
    # at initialisation the logits are near 0, so logsumexp is near log V
    assert z[0]["z_loss"] == pytest.approx(1e-4 * math.log(TINY_VOCAB) ** 2, rel=0.02)
    assert all(r["z_loss"] > 0 for r in z)
    assert z[-1]["loss"] != plain[-1]["loss"]  # ... and the term changed the updates
    assert abs(z[-1]["loss"] - plain[-1]["loss"]) < 0.05  # by little at this weight
    assert qk[-1]["loss"] < qk[0]["loss"] - 0.5  # a QK-norm model learns

    from scse_dist.checkpoint.export import load_exported_model

    model, cfg = load_exported_model(tmp_path / "qk" / "runs" / "tiny" / "export")
    assert cfg.model.qk_norm is True and cfg.train.loss.z_loss == 1e-4
    gains = model.core.blocks[0].attn.q_norm.weight
    assert gains.shape == (16,) and (gains - 1).abs().max() > 0  # trained, not left at ones
