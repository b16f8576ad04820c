"""Crash retries on a real single-node Slurm (slurm/local-cluster.sh), 2 ranks (gloo, CPU), the
fault injected into rank 1 (SCSE_FAULT): a crash at the first start only is retried once and the
run ends exactly as an uninterrupted one (scse-launch, through submitit); a crash at every start
stops after the second identical failure, in one line, and its evaluations never run
(slurm/pretrain.sh)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from slurm_cluster import running_cluster
from test_slurm_e2e import FINAL, job_info, logs, scheduled, submit, wait_final
from test_slurm_pretrain import sbatch
from train_procs import all_passed, train_ranks

pytestmark = pytest.mark.slow
STEPS = ("train.max_steps=12", "train.checkpoint.every=5", "train.log_every=1")
CRASH = "RuntimeError: fault: crash at step 8"


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster(nodes=1)


@pytest.fixture
def fault(monkeypatch):
    """SCSE_FAULT for the jobs submitted next (sbatch passes the environment on)."""
    monkeypatch.setenv("SCSE_DIST_TIMEOUT_S", "30")  # a dead peer ends the survivor in bounded time
    return lambda spec: monkeypatch.setenv("SCSE_FAULT", spec)


def release_requeued(job: str, restarts: int, tmp_path: Path) -> None:
    """Once the job was requeued `restarts` times: Slurm holds a requeued job back (BeginTime,
    about two minutes); release it in a few seconds (not at once: slurmd refuses a credential
    from the same second as the revoked one)."""
    deadline = time.monotonic() + 180
    while int((info := job_info(job))["Restarts"]) < restarts or \
            info["JobState"] not in ("PENDING", "RUNNING"):
        assert time.monotonic() < deadline and info["JobState"] not in FINAL, (info, logs(tmp_path))
        time.sleep(0.2)
    if info["JobState"] == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"], check=True)


def train_rows(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "kind" not in r]


def test_a_crash_at_the_first_start_is_retried_and_ends_as_an_uninterrupted_run(
        slurm_cluster, tmp_path, fault, subprocess_env):
    fault("crash_once@8:rank1")
    train = submit(tmp_path, "name=once", "resources.tasks_per_node=2", *STEPS)
    run_dir = tmp_path / "runs" / "once"
    ids = scheduled(run_dir)
    release_requeued(train, 1, tmp_path)
    info = wait_final(train, timeout_s=240)
    out = logs(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    line = (f"scse-launch: training crashed on rank 1 after step 7 (exit 1: {CRASH}): retry 1 of "
            f"2, requeueing job {train}; it resumes from the latest verified checkpoint "
            "(step-0000005)")
    assert out.count(line) == 1, out
    assert out.count("resumed") == 1 and "at step 5 (data stream and RNG restored)" in out
    starts = json.loads((run_dir / "logs" / "retries.json").read_text())["starts"]
    assert [(s["job"], s["start"], s["rank"], s["exit"], s["step"], s["signature"],
             s["decision"]) for s in starts] == [(train, 0, 1, 1, 7, CRASH, "retry")]

    # The same run without the fault, at the same world size, outside Slurm: the same losses.
    ref = tmp_path / "reference"
    all_passed(train_ranks(str(REPO_ROOT / "configs" / "tiny-cpu.yaml"), subprocess_env,
                           "name=ref", f"output_dir={ref}", f"data.path={tmp_path}/data/shards",
                           f"data.tokenizer={tmp_path}/data/tokenizer.model", *STEPS))
    assert train_rows(run_dir) == train_rows(ref / "ref")
    assert [step for step, _ in train_rows(run_dir)] == list(range(1, 13))
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        assert wait_final(job)["JobState"] == "COMPLETED", logs(tmp_path)


def test_a_crash_at_every_start_stops_after_the_second_identical_failure(
        slurm_cluster, tmp_path, fault, tiny_config):
    fault("crash@8:rank1")
    home = tmp_path / "elsewhere"
    home.mkdir()
    cfg = tiny_config(tmp_path, "name=every", *STEPS, "eval.tasks=[heldout]")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    train = sbatch(home, {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}, cfg)
    run_dir = tmp_path / "runs" / "every"
    ids = scheduled(run_dir)
    release_requeued(train, 1, tmp_path)
    info = wait_final(train, timeout_s=240)
    out = logs(tmp_path)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", (info, out)
    record = run_dir / "logs" / "retries.json"
    assert out.count(f"(exit 1: {CRASH}): retry 1 of 2, requeueing job {train}") == 1, out
    stop = (f"scse-launch: training crashed on rank 1 after step 7 (exit 1: {CRASH}): the same "
            f"failure after the same step as start 1 of job {train}; not retrying, it would fail "
            f"again ({record})")
    assert out.count(stop) == 1, out
    assert out.count("at step 5 (data stream and RNG restored)") == 1  # the second start resumed
    starts = json.loads(record.read_text())["starts"]
    assert [(s["start"], s["rank"], s["step"], s["decision"]) for s in starts] == \
        [(0, 1, 7, "retry"), (1, 1, 7, "stop")]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000005"
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        evaluated = wait_final(job)
        assert evaluated["JobState"] == "CANCELLED" or \
            evaluated["Reason"] == "DependencyNeverSatisfied", evaluated
    assert not (run_dir / "eval" / "heldout.json").exists()
