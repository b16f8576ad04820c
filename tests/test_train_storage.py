"""A run whose output_dir is s3:// (moto's server on loopback, s3fs): trained in a local staging dir
and mirrored; preempted, then resumed on a "new machine" (empty staging) from S3 alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scse_dist.checkpoint.export import is_remote
from scse_dist.checkpoint.storage import RunStorage
from scse_dist.distributed import free_port
from train_procs import RankResult

pytest.importorskip("s3fs")

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
S3_ENV = ("FSSPEC_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")

pytestmark = pytest.mark.slow


def train(config: str, env: dict, *overrides: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = dict(env, **{k: os.environ[k] for k in S3_ENV}, **extra_env)
    return subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=240)


def tail(out: subprocess.CompletedProcess) -> str:
    return f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_local_output_dirs_are_used_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("SCSE_STAGING_DIR", str(tmp_path / "stage"))
    assert not is_remote("runs/x") and not is_remote("file:///tmp/x") and is_remote("s3://b/x")
    storage = RunStorage(str(tmp_path / "runs" / "x"), "x")
    assert storage.remote is None and storage.local == tmp_path / "runs" / "x"
    remote = RunStorage("memory://bucket/runs/x", "x")
    assert remote.remote == "memory://bucket/runs/x" and remote.local == tmp_path / "stage" / "x"


def test_s3_run_is_mirrored_and_resumes_on_a_new_machine_from_s3_alone(
        s3_bucket, tmp_path, tiny_config, subprocess_env):
    import fsspec
    from safetensors.torch import load_file

    for name in ("local", "remote"):
        (tmp_path / name).mkdir()
    # The reference: the same 20 steps, uninterrupted, on local disk.
    local_cfg = tiny_config(tmp_path / "local")
    out = train(local_cfg, subprocess_env)
    assert out.returncode == 0, tail(out)
    reference = load_file(str(tmp_path / "local" / "runs" / "tiny" / "export"
                              / "model.safetensors"))

    remote_cfg = tiny_config(tmp_path / "remote", f"output_dir={s3_bucket}/runs")
    # Machine 1: preempted as step 12 starts; it saves step 12 and exits for a requeue.
    out = train(remote_cfg, subprocess_env, SCSE_FAULT="sigterm@12",
                SCSE_STAGING_DIR=str(tmp_path / "machine1"))
    assert out.returncode == 75, tail(out)
    assert (tmp_path / "machine1" / "tiny" / "checkpoints" / "step-0000012").is_dir()
    fs = fsspec.filesystem("s3")
    run = "scse-test/runs/tiny"
    assert fs.cat_file(f"{run}/checkpoints/latest").decode() == "step-0000012"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{run}/checkpoints")) == \
        ["latest", "step-0000010", "step-0000012"]
    assert fs.isfile(f"{run}/config.yaml") and not fs.exists(f"{run}/export")
    assert [json.loads(r)["step"]
            for r in fs.cat_file(f"{run}/metrics.jsonl").decode().splitlines()] == [1, 5, 10]

    # Machine 2: empty staging; everything it resumes from comes from S3.
    out = train(remote_cfg, subprocess_env, SCSE_STAGING_DIR=str(tmp_path / "machine2"))
    assert out.returncode == 0, tail(out)
    fs.invalidate_cache()  # s3fs caches listings; the bucket changed in another process
    assert "at step 12 (data stream and RNG restored)" in out.stdout, tail(out)
    assert not (tmp_path / "remote" / "runs").exists()  # nothing written under a local output_dir
    # Remote retention mirrors local (train.checkpoint.keep=2): step 10 is gone from S3 too.
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{run}/checkpoints")) == \
        ["latest", "step-0000012", "step-0000020"]
    assert fs.cat_file(f"{run}/checkpoints/latest").decode() == "step-0000020"
    rows = [json.loads(r)["step"]
            for r in fs.cat_file(f"{run}/metrics.jsonl").decode().splitlines()]
    assert rows == [1, 5, 10, 13, 15, 20]  # machine 1's rows, then the resumed run's
    exported = tmp_path / "exported.safetensors"
    fs.get_file(f"{run}/export/model.safetensors", str(exported))
    assert fs.isfile(f"{run}/export/config.yaml")
    resumed = load_file(str(exported))
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


def test_two_nodes_with_their_own_staging_upload_their_shards_and_resume_from_s3(
        s3_bucket, tmp_path, tiny_config, subprocess_env):
    """2 ranks as 2 "nodes" (LOCAL_RANK 0 each, separate staging dirs), ZeRO-2: each rank's
    optimizer shard exists only on its node, so the remote tag is complete only if both nodes
    upload."""
    import fsspec

    (tmp_path / "cfg").mkdir()
    cfg = tiny_config(tmp_path / "cfg", f"output_dir={s3_bucket}/runs", "train.engine.zero_stage=2",
                      "train.max_steps=6", "train.checkpoint.every=3", "train.log_every=3")
    base = dict(subprocess_env, **{k: os.environ[k] for k in S3_ENV})

    results = run_ranks_per_node(cfg, base, tmp_path / "first", SCSE_FAULT="sigterm@4")
    assert [r.returncode for r in results] == [75, 75], results[0].tail() + results[1].tail()
    fs = fsspec.filesystem("s3")
    tag = "scse-test/runs/tiny/checkpoints/step-0000004"
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(tag))
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in names
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in names
    node1 = tmp_path / "first" / "node1" / "tiny" / "checkpoints"
    assert not list(node1.glob(".tmp-*")) and not list(node1.glob("step-*"))  # moved to S3

    results = run_ranks_per_node(cfg, base, tmp_path / "second")
    assert [r.returncode for r in results] == [0, 0], results[0].tail() + results[1].tail()
    assert "at step 4 (data stream and RNG restored)" in results[0].stdout
    fs.invalidate_cache()
    assert fs.cat_file("scse-test/runs/tiny/checkpoints/latest").decode() == "step-0000006"


def run_ranks_per_node(cfg: str, env: dict, staging: Path, **extra: str) -> list[RankResult]:
    """2 ranks, each LOCAL_RANK 0 of its own "node" with its own staging dir."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, TRAIN, "--config", cfg], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(env, **extra, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       SCSE_STAGING_DIR=str(staging / f"node{rank}")))
             for rank in range(2)]
    outputs = [p.communicate(timeout=240) for p in procs]
    return [RankResult(rank, p.returncode, *out)
            for rank, (p, out) in enumerate(zip(procs, outputs))]
