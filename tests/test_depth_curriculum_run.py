"""train.depth.curriculum in real runs: each row logs the mean its step drew around and the depth
it drew; a run resumed mid-ramp ends bit for bit where the uninterrupted run does; off, the rows
carry no depth_mean.

The reference: 20 steps of the tiny config at model.depth 4, poisson_lognormal, the mean ramping
linearly from 1 over the first 15 steps, a checkpoint every 6.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scse_dist.config import load_config
from scse_dist.train.depth import depth_mean, sample_depth
from train_procs import REPO, TRAIN, read_metrics

pytestmark = pytest.mark.slow

RAMP = ("model.depth=4", "train.depth.kind=poisson_lognormal", "train.depth.min=1",
        "train.depth.curriculum.shape=linear", "train.depth.curriculum.fraction=0.75",
        "train.log_every=1", "train.checkpoint.every=6", "train.checkpoint.keep=10")
EXPORT = Path("export") / "model.safetensors"


def train(config: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def rows(run_dir: Path) -> list[dict]:
    """Training rows without their timings (the rest is a pure function of the run)."""
    timing = {"tokens_per_s", "step_time_s", "mfu"}
    return [{k: v for k, v in r.items() if k not in timing and not k.startswith("peak_")}
            for r in read_metrics(run_dir) if "kind" not in r]


def same_export(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a / EXPORT), load_file(b / EXPORT)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config, subprocess_env):
    root = tmp_path_factory.mktemp("ramp")
    config = tiny_config(root, *RAMP)
    out = train(config, subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return config, root / "runs" / "tiny"


def test_rows_log_the_ramp_and_its_draws(reference):
    config, run_dir = reference
    t = load_config(config).train
    got = rows(run_dir)
    assert [r["depth_mean"] for r in got] == [depth_mean(s, t.depth, 4, 20) for s in range(20)]
    assert [r["depth"] for r in got] == [sample_depth(s, t.depth, 4, t.seed, 20)
                                         for s in range(20)]
    assert got[0]["depth_mean"] == 1.0 and got[15]["depth_mean"] == got[19]["depth_mean"] == 4.0
    assert got[7]["depth_mean"] == pytest.approx(1 + 3 * 7 / 15)


def test_a_resume_mid_ramp_is_the_uninterrupted_run(reference, tmp_path, tiny_config,
                                                    subprocess_env):
    _, reference_dir = reference
    run_dir = tmp_path / "runs" / "tiny"
    shutil.copytree(reference_dir, run_dir)
    out = train(tiny_config(tmp_path, *RAMP), subprocess_env, "train.start.resume_from=step-6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed" in out.stdout
    again = rows(run_dir)
    assert [r["step"] for r in again] == list(range(1, 21))
    assert 1.0 < again[6]["depth_mean"] < 4.0  # step 7 is inside the ramp
    assert again == rows(reference_dir)  # losses, depths and means of steps 7-20 bit for bit
    assert same_export(run_dir, reference_dir)


def test_off_rows_have_no_depth_mean(tmp_path, tiny_config, subprocess_env):
    out = train(tiny_config(tmp_path, "train.max_steps=2", "train.log_every=1"), subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = rows(tmp_path / "runs" / "tiny")
    assert len(got) == 2 and all("depth" in r and "depth_mean" not in r for r in got)
