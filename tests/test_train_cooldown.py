"""Schedules in real runs: a wsd run resumed mid-decay is the uninterrupted run bit for bit, a
cooldown branched off a constant-LR run's checkpoint is the wsd run's decay bit for bit, and a
plain resume follows a changed schedule from its step (and says so).

The reference is one tiny wsd run: 20 steps, warmup 2, stable to step 12, a linear decay over the
last 8 (steps 13-20), a checkpoint every 6 steps.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scse_dist.config import load_config
from scse_dist.train.schedule import LRSchedule
from train_procs import REPO, TRAIN, read_metrics

pytestmark = pytest.mark.slow

WSD = ("train.schedule.kind=wsd", "train.schedule.decay_steps=8", "train.log_every=1",
       "train.checkpoint.every=6", "train.checkpoint.keep=10")
EXPORT = Path("export") / "model.safetensors"


def train(config: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    return out


def rows(run_dir: Path) -> list[dict]:
    """Training rows without their timings (the rest is a pure function of the run)."""
    timing = {"tokens_per_s", "step_time_s", "mfu"}
    return [{k: v for k, v in r.items() if k not in timing and not k.startswith("peak_")}
            for r in read_metrics(run_dir) if "kind" not in r]


def same_export(a: Path, b: Path) -> bool:
    """Both exports hold the same tensors bit for bit (the header's metadata order may vary)."""
    from safetensors.torch import load_file

    x, y = load_file(a / EXPORT), load_file(b / EXPORT)
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config, subprocess_env):
    """(config path, run dir) of the uninterrupted wsd run."""
    root = tmp_path_factory.mktemp("wsd")
    config = tiny_config(root, *WSD)
    out = train(config, subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return config, root / "runs" / "tiny"


def test_the_reference_follows_the_wsd_curve(reference):
    config, run_dir = reference
    lrs = [r["lr"] for r in rows(run_dir)]
    f = LRSchedule.from_config(load_config(config).train)
    assert lrs == [3e-3 * f(s) for s in range(20)]
    assert lrs[1:12] == [3e-3] * 11 and lrs[12] < 3e-3 and lrs[-1] == pytest.approx(3e-4)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-0000006", "step-0000012", "step-0000018", "step-0000020"]


def test_a_resume_mid_decay_is_the_uninterrupted_run(reference, tmp_path, tiny_config,
                                                     subprocess_env):
    _, reference_dir = reference
    run_dir = tmp_path / "runs" / "tiny"
    shutil.copytree(reference_dir, run_dir)
    out = train(tiny_config(tmp_path, *WSD), subprocess_env, "train.start.resume_from=step-18")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed" in out.stdout and "train.schedule:" not in out.stdout
    again = rows(run_dir)
    assert [r["step"] for r in again] == list(range(1, 21))
    assert 3e-4 < again[17]["lr"] < 3e-3  # step 18 is inside the decay
    assert again == rows(reference_dir)  # losses and LRs of steps 19-20 bit for bit
    assert same_export(run_dir, reference_dir)


def test_a_cooldown_branched_off_a_stable_run_is_the_wsd_decay(reference, tmp_path, tiny_config,
                                                              subprocess_env):
    _, reference_dir = reference
    base = ("train.log_every=1", "train.checkpoint.every=6", "train.checkpoint.keep=10")
    stable_dir = tmp_path / "stable" / "runs" / "tiny"
    (tmp_path / "stable").mkdir()
    (tmp_path / "cool").mkdir()
    out = train(tiny_config(tmp_path / "stable", *base, "train.schedule.kind=constant",
                            "train.max_steps=12"), subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert rows(stable_dir) == rows(reference_dir)[:12]  # constant = wsd's stable phase
    before = snapshot(stable_dir)

    source = stable_dir / "checkpoints" / "step-0000012"
    branch_dir = tmp_path / "cool" / "runs" / "tiny"
    out = train(tiny_config(tmp_path / "cool", *WSD), subprocess_env,
                f"train.start.branch_from={source}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"train.start.branch_from: starting from {source} (weights, optimizer state, step, "
            "data position and RNG; the LR schedule is this run's)") in out.stdout
    # step 13 on: the wsd run's decay, its data and optimizer state continued, bit for bit
    assert rows(branch_dir) == rows(reference_dir)[12:]
    assert same_export(branch_dir, reference_dir)
    assert snapshot(stable_dir) == before  # the stable run is left as it was
    # the branch's own checkpoints: a rerun resumes those, not the source
    out = train(tiny_config(tmp_path / "cool", *WSD), subprocess_env,
                f"train.start.branch_from={source}", "train.max_steps=20")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("train.start.branch_from ignored: resuming this run's checkpoint "
            "step-0000020") in out.stdout


def test_a_branch_of_another_model_is_refused_and_changes_nothing(reference, tmp_path,
                                                                  tiny_config, subprocess_env):
    _, reference_dir = reference
    before = snapshot(reference_dir)
    out = train(tiny_config(tmp_path, *WSD), subprocess_env,
                f"train.start.branch_from={reference_dir}",
                "model.d_model=64")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (
        f"scse-train: config error: train.start.branch_from: {reference_dir / 'checkpoints'}/"
        "step-0000020 is a checkpoint of another model or data stream: model.d_model: 32 -> 64. "
        "A branch continues the same model and token stream (train.start.init_from starts a new "
        "run from an export's weights alone)")
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()
    assert snapshot(reference_dir) == before
    # a source that is not there: a missing input, before anything starts
    out = train(tiny_config(tmp_path, *WSD), subprocess_env,
                f"train.start.branch_from={tmp_path / 'nowhere'}")
    assert out.returncode == 66
    assert out.stderr.strip() == (
        f"scse-train: error: train.start.branch_from: '{tmp_path / 'nowhere'}' does not exist")
    # one that is there but is no run dir nor tag
    out = train(tiny_config(tmp_path, *WSD), subprocess_env, f"train.start.branch_from={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"scse-train: config error: train.start.branch_from: '{tmp_path}' is neither a "
        "run dir (holding checkpoints/) nor a checkpoint tag "
        "(runs/<name>/checkpoints/step-NNNNNNN)")


def test_a_plain_resume_follows_a_changed_schedule_and_says_so(reference, tmp_path, tiny_config,
                                                              subprocess_env):
    _, reference_dir = reference
    run_dir = tmp_path / "runs" / "tiny"
    shutil.copytree(reference_dir, run_dir)
    changed = tiny_config(tmp_path, *WSD, "train.schedule.decay_shape=1-sqrt")
    out = train(changed, subprocess_env, "train.start.resume_from=step-12")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("train.schedule: step 13 runs at lr 2.0454e-03 under this config's schedule (wsd "
            "1-sqrt, decay 8 of 20 steps, warmup 2, lr 0.003); the checkpoint's (wsd linear, decay "
            "8 of 20 steps, warmup 2, lr 0.003) had 2.6625e-03") in out.stdout
    f = LRSchedule.from_config(load_config(changed).train)
    resumed = rows(run_dir)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in rows(reference_dir)[:12]] + \
        [3e-3 * f(s) for s in range(12, 20)]
    assert resumed[:12] == rows(reference_dir)[:12]
