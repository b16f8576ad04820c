"""A real single-node Slurm (slurm/local-cluster.sh): `sbatch slurm/pretrain.sh configs/tiny-cpu.yaml`
trains, and the evaluation jobs it schedules run only after it, or never when it fails; a
preemption signal makes training save, the job requeue itself and resume, without scheduling
evaluations twice."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from slurm_cluster import running_cluster

pytestmark = pytest.mark.slow
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL"}
# GPU-less, one task per node: override pretrain.sh's multi-node GPU defaults (and --nodes=2).
SBATCH = ["sbatch", "--parsable", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0",
          "--time=10"]


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster(nodes=1)


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_final(job_id: str, timeout_s: float = 180) -> dict[str, str]:
    """Poll until the job ended (or waits on a dependency that can never be met)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(job_id)
        if info["JobState"] in FINAL or info.get("Reason") == "DependencyNeverSatisfied":
            return info
        assert time.monotonic() < deadline, f"job {job_id} still {info['JobState']}: {info}"
        time.sleep(0.5)


def submit(tmp_path: Path, *overrides: str, nodes: int = 1) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run([*SBATCH, f"--nodes={nodes}", f"--output={tmp_path}/%x-%j.out", f"--error={tmp_path}/%x-%j.err",
                          "slurm/pretrain.sh", "configs/tiny-cpu.yaml", f"output_dir={tmp_path}/runs",
                          f"data.path={tmp_path}/data/shards",
                          f"data.tokenizer={tmp_path}/data/tokenizer.model",
                          # the build goes where the command line puts the data (docs/data.md)
                          "data.build=stdlib_docs", *overrides],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=env, check=True)
    return out.stdout.strip().split(";")[0]


def scheduled(run_dir: Path, timeout_s: float = 60) -> dict:
    marker = run_dir / "eval" / "scheduled.json"
    deadline = time.monotonic() + timeout_s
    while not marker.is_file():
        assert time.monotonic() < deadline, f"{marker} never appeared"
        time.sleep(0.2)
    return json.loads(marker.read_text())


def logs(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in sorted(tmp_path.glob("scse-pretrain-*")))


def preempt_and_wait(train: str, run_dir: Path, tmp_path: Path) -> dict[str, str]:
    """Once training logged a step, send what Slurm's --signal=USR1@120 sends near the time limit
    (SIGUSR1 to the job's steps, i.e. every task on every node), and wait until the requeued job
    ended. Returns its final `scontrol show job`."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, logs(tmp_path)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", train], check=True)
    # Slurm holds a requeued job back (BeginTime, about two minutes); release it sooner. Not at
    # once: slurmd refuses a credential from the same second as the revoked one of the first run.
    deadline = time.monotonic() + 120
    while (info := job_info(train))["Restarts"] == "0" or info["JobState"] not in ("PENDING", "RUNNING"):
        assert time.monotonic() < deadline and info["JobState"] not in FINAL, (info, logs(tmp_path))
        time.sleep(0.2)
    if info["JobState"] == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={train}", "StartTime=now+5"], check=True)
    return wait_final(train, timeout_s=240)


def test_training_then_dependent_evaluations_and_report(slurm_cluster, tmp_path):
    import matplotlib.image

    train = submit(tmp_path, "name=e2e")
    run_dir = tmp_path / "runs" / "e2e"
    ids = scheduled(run_dir)
    assert ids["train_job"] == train and set(ids["eval_jobs"]) == {"heldout", "diagnose"}
    trained = wait_final(train)
    assert trained["JobState"] == "COMPLETED", logs(tmp_path)
    ended = trained["EndTime"]
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        info = wait_final(job)
        assert info["JobState"] == "COMPLETED", (info, list((run_dir / "slurm").glob("*")))
        assert info["StartTime"] >= ended  # ISO timestamps: afterok held them until training ended
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    diagnose = json.loads((run_dir / "eval" / "diagnose.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2, 4] == [r["depth"] for r in diagnose["results"]]
    assert all(r["ppl"] < 512 for r in heldout["results"])  # below a uniform guess over 512 pieces
    report = (run_dir / "eval" / "report.md").read_text()
    assert f"| e2e (scse) | heldout | ppl | {heldout['results'][0]['ppl']:.4f} |" in report
    assert matplotlib.image.imread(str(run_dir / "eval" / "frontier.png")).shape[0] > 100


def test_failed_training_never_runs_the_evaluations(slurm_cluster, tmp_path):
    # no data and no data.build: training fails at start-up, after scheduling its evaluations
    train = submit(tmp_path, "name=broken", "data.build=null")
    run_dir = tmp_path / "runs" / "broken"
    ids = scheduled(run_dir)
    assert wait_final(train)["JobState"] == "FAILED"
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        info = wait_final(job)
        assert info["JobState"] == "CANCELLED" or info["Reason"] == "DependencyNeverSatisfied", info
        assert not list((run_dir / "slurm").glob(f"*-{job}.out"))  # Slurm never started it
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["scheduled.json"]


def test_preemption_signal_requeues_and_resumes_without_rescheduling(slurm_cluster, tmp_path):
    train = submit(tmp_path, "name=preempt", "train.max_steps=60", "train.checkpoint_every=1000")
    run_dir = tmp_path / "runs" / "preempt"
    ids = scheduled(run_dir)
    info = preempt_and_wait(train, run_dir, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    out = logs(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    assert f"requeueing job {train}" in out and "resumed" in out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 60 and steps.index(60) > 0
    assert json.loads((run_dir / "eval" / "scheduled.json").read_text()) == ids  # not rescheduled
    jobs = subprocess.run(["squeue", "-t", "all", "-h", "-o", "%i %j"], capture_output=True,
                          text=True, check=True).stdout.split("\n")
    names = [j.split()[1] for j in jobs if j.strip() and int(j.split()[0]) > int(train)]
    assert names.count("preempt-eval") == 2 and names.count("preempt-report") == 1
    assert wait_final(ids["report_job"])["JobState"] == "COMPLETED"


def test_scse_launch_submits_pretrain_sh_with_config_and_overrides(slurm_cluster, tmp_path):
    out = subprocess.run([sys.executable, "-m", "scse_dist.launch.scheduler", "configs/tiny-cpu.yaml",
                          "name=held", f"output_dir={tmp_path}/runs", "--sbatch-args",
                          f"--hold --parsable --nodes=1 --ntasks-per-node=1 --gpus-per-node=0 "
                          f"--output={tmp_path}/%x-%j.out"],
                         capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    job = out.stdout.strip().split(";")[0]
    try:
        info = job_info(job)
        assert info["JobName"] == "scse-pretrain" and info["Requeue"] == "1"
        script = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True,
                                text=True, check=True).stdout
        assert "--signal=USR1@120" in script
        args = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True,
                              check=True).stdout
        assert (f"Command={REPO_ROOT}/slurm/pretrain.sh configs/tiny-cpu.yaml name=held "
                f"output_dir={tmp_path}/runs") in args
    finally:
        subprocess.run(["scancel", job], check=True)
