"""A real single-node Slurm (slurm/local-cluster.sh): `scse-launch configs/tiny-cpu.yaml`, run from
a directory outside the checkout, submits the training job through submitit; it trains, and the
evaluation jobs it schedules run only after it, or never when it fails; a preemption signal makes
training save, the job requeue itself and resume, without scheduling evaluations twice."""

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


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`scse-launch ...` as a user runs it, from a directory outside the checkout."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(key, None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return subprocess.run(["scse-launch", *args], capture_output=True, text=True, cwd=elsewhere,
                          env=env)


def submit(tmp_path: Path, *overrides: str, nodes: int = 1) -> str:
    out = launch(tmp_path, str(REPO_ROOT / "configs" / "tiny-cpu.yaml"),
                 f"output_dir={tmp_path}/runs", f"data.path={tmp_path}/data/shards",
                 f"data.tokenizer={tmp_path}/data/tokenizer.model",
                 # the build goes where the command line puts the data (docs/data.md)
                 "data.build=stdlib_docs", f"resources.nodes={nodes}", "resources.time_min=10",
                 *overrides)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]  # the job id alone


def scheduled(run_dir: Path, timeout_s: float = 60) -> dict:
    marker = run_dir / "eval" / "scheduled.json"
    deadline = time.monotonic() + timeout_s
    while not marker.is_file():
        assert time.monotonic() < deadline, f"{marker} never appeared"
        time.sleep(0.2)
    return json.loads(marker.read_text())


def logs(tmp_path: Path) -> str:
    """Every log of every run's jobs (submitit's <job>_<task>_log.out/.err in RUN/logs)."""
    return "".join(p.read_text(errors="replace")
                   for p in sorted(tmp_path.glob("runs/*/logs/*_log.*")))


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
    while (info := job_info(train))["Restarts"] == "0" or \
            info["JobState"] not in ("PENDING", "RUNNING"):
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
        assert info["JobState"] == "COMPLETED", (info, logs(tmp_path))
        assert info["StartTime"] >= ended  # ISO timestamps: afterok held them until training ended
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    diagnose = json.loads((run_dir / "eval" / "diagnose.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2, 4] == \
        [r["depth"] for r in diagnose["results"]]
    assert all(r["ppl"] < 512 for r in heldout["results"])  # below a uniform guess over 512 pieces
    report = (run_dir / "eval" / "report.md").read_text()
    assert f"| e2e (scse) | heldout | ppl | {heldout['results'][0]['ppl']:.4f} |" in report
    assert matplotlib.image.imread(str(run_dir / "eval" / "frontier.png")).shape[0] > 100


def test_failed_training_never_runs_the_evaluations(slurm_cluster, tmp_path):
    # nothing to resume under resume=require: training fails at start-up, after scheduling its
    # evaluations (a missing input would be refused before anything queues)
    train = submit(tmp_path, "name=broken", "train.start.resume=require")
    run_dir = tmp_path / "runs" / "broken"
    ids = scheduled(run_dir)
    assert wait_final(train)["JobState"] == "FAILED"
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        info = wait_final(job)
        assert info["JobState"] == "CANCELLED" or info["Reason"] == "DependencyNeverSatisfied", info
        assert not list((run_dir / "logs").glob(f"{job}_*_log.out"))  # Slurm never started it
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["scheduled.json"]
    assert "scse-train: config error: train.start.resume" in logs(tmp_path)


def test_preemption_signal_requeues_and_resumes_without_rescheduling(slurm_cluster, tmp_path):
    train = submit(tmp_path, "name=preempt", "train.max_steps=60", "train.checkpoint.every=1000")
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


def test_scse_launch_submits_through_submitit_from_any_directory(slurm_cluster, tmp_path):
    out = launch(tmp_path, str(REPO_ROOT / "configs" / "tiny-cpu.yaml"), "name=held",
                 f"output_dir={tmp_path}/runs", "resources.cpus_per_task=2",
                 "--backend-args=--hold --comment=mine")
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().splitlines()[-1]
    try:
        info = job_info(job)
        assert (info["JobName"], info["Requeue"], info["NumCPUs"], info["Comment"]) == \
            ("held", "1", "2", "mine"), info
        assert info["WorkDir"] == str(tmp_path / "elsewhere")  # the directory it was submitted in
        script = subprocess.run(["scontrol", "write", "batch_script", job, "-"],
                                capture_output=True, text=True, check=True).stdout
        assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script
        assert "#SBATCH --hold" in script and "-m submitit.core._submit" in script
        assert f"--output {tmp_path}/runs/held/logs/%j_%t_log.out" in script
        # what every task runs: the installed training entry point, the config by its full path
        import submitit

        task = submitit.SlurmJob(folder=tmp_path / "runs" / "held" / "logs",
                                 job_id=job).submission()
        assert task.function.command == [
            sys.executable, "-m", "scse_dist.launch.run_job", "train",
            str(REPO_ROOT / "configs" / "tiny-cpu.yaml"), "name=held",
            f"output_dir={tmp_path}/runs",
            "resources.cpus_per_task=2", "--schedule-evals=slurm"]
    finally:
        subprocess.run(["scancel", job], check=True)
