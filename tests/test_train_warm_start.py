"""train.start.init_from: a new run starts from an export's weights (only), strictly by default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_procs import TRAIN

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def train(config: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=240)


def tail(out: subprocess.CompletedProcess) -> str:
    return f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


@pytest.fixture(scope="module")
def source_export(tiny_config, tmp_path_factory, subprocess_env) -> Path:
    """A tiny model trained 4 steps and exported."""
    root = tmp_path_factory.mktemp("source")
    out = train(tiny_config(root, "name=source", "train.max_steps=4"), subprocess_env)
    assert out.returncode == 0, tail(out)
    return root / "runs" / "source" / "export"


def test_warm_start_at_another_depth_starts_from_the_export_and_a_resume_ignores_it(
        source_export, tiny_config, tmp_path, subprocess_env):
    source = load_file(str(source_export / "model.safetensors"))
    # One step whose lr is 3e-3 / 1e6: the exported weights are the step-0 weights to ~1e-8,
    # while the source's own 4 steps moved them by ~1e-3 (so a fresh init could not pass).
    cfg = tiny_config(tmp_path, "name=warm", "model.depth=3", "train.max_steps=1",
                      "train.schedule.warmup_steps=1000000", f"train.start.init_from=file://{source_export}")
    out = train(cfg, subprocess_env)
    assert out.returncode == 0, tail(out)
    assert f"warm start from file://{source_export}: weights only" in out.stdout
    assert "skipped" not in out.stdout
    warm = load_file(str(tmp_path / "runs" / "warm" / "export" / "model.safetensors"))
    assert warm.keys() == source.keys()
    for key in source:
        torch.testing.assert_close(warm[key], source[key], rtol=0, atol=1e-7, msg=key)
    assert "steps 0..1" in out.stdout  # a new schedule and data position: step 0, not step 4

    out = train(cfg, subprocess_env, "train.max_steps=2")  # the run has a checkpoint now
    assert out.returncode == 0, tail(out)
    assert out.stdout.count("train.start.init_from ignored: resuming this run's checkpoint") == 1
    assert "warm start" not in out.stdout and \
        "at step 1 (data stream and RNG restored)" in out.stdout


def test_a_changed_width_is_refused_naming_the_key(source_export, tiny_config, tmp_path,
                                                   subprocess_env):
    out = train(tiny_config(tmp_path, "name=wide", "model.d_model=48",
                            f"train.start.init_from={source_export}"), subprocess_env)
    assert out.returncode == 65, tail(out)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"scse-train: error: train.start.init_from: {source_export} does not "
                           "fit this model; shape mismatch: coda.0.attn.proj.weight: file "
                           "(32, 32) vs model (48, 48), "), last
    assert "init_from_strict: false" in last and "Traceback" not in out.stderr


def test_non_strict_loads_what_fits_and_lists_what_it_skipped(source_export, tiny_config, tmp_path,
                                                              subprocess_env):
    source = load_file(str(source_export / "model.safetensors"))
    cfg = tiny_config(tmp_path, "name=deeper", "model.n_coda=2", "train.max_steps=1",
                      "train.schedule.warmup_steps=1000000",
                      f"train.start.init_from={source_export}",
                      "train.start.init_from_strict=false")
    out = train(cfg, subprocess_env)
    assert out.returncode == 0, tail(out)
    line = next(x for x in out.stdout.splitlines() if x.startswith("warm start"))
    skipped = line.split("; skipped ", 1)[1]
    new_keys = sorted(k for k in load_file(str(tmp_path / "runs" / "deeper" / "export" /
                                                "model.safetensors")) if k.startswith("coda.1."))
    assert new_keys and \
        skipped == f"{len(new_keys)}: " + ", ".join(f"missing {k}" for k in new_keys)
    warm = load_file(str(tmp_path / "runs" / "deeper" / "export" / "model.safetensors"))
    for key in source:  # every key that fits came from the export
        torch.testing.assert_close(warm[key], source[key], rtol=0, atol=1e-7, msg=key)


@pytest.mark.parametrize("override, change", [
    ("model.rope_theta=500000", "model.rope_theta: 10000.0 -> 500000.0"),
    ("model.norm_eps=1e-5", "model.norm_eps: 1e-06 -> 1e-05"),
])
def test_a_model_field_that_keeps_the_shapes_is_refused_naming_it(
        source_export, tiny_config, tmp_path, subprocess_env, override, change):
    cfg = tiny_config(tmp_path, "name=other", override, f"train.start.init_from={source_export}")
    before = sorted(tmp_path.rglob("*"))
    out = train(cfg, subprocess_env)
    assert out.returncode == 2, tail(out)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"scse-train: config error: train.start.init_from: {source_export} is another model than "
        f"this run's: {change} (export -> run); start from its config with `base: "
        f"{source_export}/config.yaml`"), lines
    assert "Traceback" not in out.stderr
    assert sorted(tmp_path.rglob("*")) == before  # refused before anything is built or written
