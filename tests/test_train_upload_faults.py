"""Uploads that cannot lose a checkpoint: refused and slow PUTs, a kill mid-upload (moto on
loopback, real training processes). The remote `latest` must only ever name a complete tag, a tag
the remote lacks must stay in staging, and a new machine must resume from the bucket alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_procs import TRAIN

REPO = Path(__file__).resolve().parents[1]
S3_ENV = ("FSSPEC_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
RUN = "runs/tiny"

pytest.importorskip("s3fs")
pytestmark = pytest.mark.slow


def train(config: str, env: dict, **extra_env: str) -> subprocess.CompletedProcess:
    # botocore's own retries off, so that every injected 503 reaches the trainer's retry loop.
    env = dict(env, **{k: os.environ[k] for k in S3_ENV}, AWS_MAX_ATTEMPTS="1",
               SCSE_UPLOAD_ATTEMPTS="2", SCSE_UPLOAD_BACKOFF_S="0.05", **extra_env)
    return subprocess.run([sys.executable, TRAIN, "--config", config], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)


def tail(out: subprocess.CompletedProcess) -> str:
    return f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_refused_slow_and_killed_uploads_lose_nothing(s3_bucket, s3_traffic, tmp_path,
                                                      tiny_config, subprocess_env):
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    keys = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets["scse-test"].keys
    machine1 = tmp_path / "machine1" / "tiny" / "checkpoints"
    published = []  # at every PUT of the remote latest: (tag, its remote files, staging's tags)

    def snapshot(_path: str) -> None:
        tag = keys[f"{RUN}/checkpoints/latest"].value.decode()
        prefix = f"{RUN}/checkpoints/{tag}/"
        files = sorted(k[len(prefix):] for k in list(keys.keys()) if k.startswith(prefix))
        local = sorted(p.name for p in machine1.glob("step-*")) if machine1.is_dir() else []
        published.append((tag, files, local))

    s3_traffic.on_latest = snapshot
    s3_traffic.refuse = {"checkpoints/step-0000010/": 3}  # 2 tries at save 10, 1 more at save 15
    s3_traffic.put_delay = 0.05
    (tmp_path / "cfg").mkdir()
    cfg = tiny_config(tmp_path / "cfg", f"output_dir={s3_bucket}/runs", "train.checkpoint.every=5",
                      "train.checkpoint.keep=1")
    out = train(cfg, subprocess_env, SCSE_FAULT="kill_in_upload@20",
                SCSE_STAGING_DIR=str(tmp_path / "machine1"))
    assert out.returncode == -9, tail(out)  # SIGKILLed after step 20's first file was uploaded
    assert len(s3_traffic.refused) == 3
    failed = [x for x in out.stdout.splitlines() if x.startswith("upload of step-0000010")]
    assert len(failed) == 1 and "(after 2 attempts)" in failed[0] and \
        "is retried at the next save" in failed[0], tail(out)
    shards = sorted(p.name for p in (machine1 / "step-0000020").iterdir())
    # step 10 never became latest; save 15 uploaded it (retry) and then 15, published once both
    # were complete; step 20 was cut off after its first file.
    assert [(tag, files) for tag, files, _ in published] == \
        [("step-0000005", shards), ("step-0000015", shards)]
    # train.checkpoint.keep=1, yet staging kept step 10 while the remote lacked it.
    assert published[1][2] == ["step-0000010", "step-0000015"]
    remote_20 = [k for k in keys.keys() if k.startswith(f"{RUN}/checkpoints/step-0000020/")]
    assert 1 <= len(remote_20) < len(shards)
    assert keys[f"{RUN}/checkpoints/latest"].value == b"step-0000015"

    # A new machine (empty staging), no faults: resumes from the bucket alone.
    s3_traffic.put_delay = 0.0
    out = train(cfg, subprocess_env, SCSE_STAGING_DIR=str(tmp_path / "machine2"))
    assert out.returncode == 0, tail(out)
    assert "at step 15 (data stream and RNG restored)" in out.stdout, tail(out)
    assert [tag for tag, _, _ in published[2:]] == ["step-0000020"]
    assert all(files == shards for _, files, _ in published)
    assert keys[f"{RUN}/checkpoints/latest"].value == b"step-0000020"
    assert f"{RUN}/export/model.safetensors" in keys
