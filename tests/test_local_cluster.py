"""slurm/local-cluster.sh is safe to share: a job running on a cluster survives `start` (which
keeps the cluster and says so), a refused reconfiguration, a refused `stop`, and a whole run of the
Slurm tests' cluster fixture; `status` counts a busy node as up; only `stop --force` ends it."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from slurm_cluster import TEST_CLUSTER, cluster, running_cluster, skip_without_slurm

pytestmark = pytest.mark.slow


def job_fields(job: str, conf: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True,
                         check=True, env=dict(os.environ, SLURM_CONF=conf)).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def test_a_running_job_survives_start_stop_and_the_test_clusters_fixture(tmp_path):
    skip_without_slurm()
    # A user's cluster, as `bash slurm/local-cluster.sh start` makes one, in its own dir and port
    # (not /etc/slurm: the machine's default cluster is not this test's to use).
    user = {"SCSE_SLURM_DIR": str(tmp_path / "user"),
            "SCSE_SLURM_CONF": str(tmp_path / "user/etc/slurm.conf"),
            "SCSE_SLURM_PORT": "6990"}
    conf = user["SCSE_SLURM_CONF"]
    assert cluster("status", settings=user).returncode == 1
    started = cluster("start", settings=user)
    assert started.returncode == 0, started.stderr
    try:
        job = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 600"],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, SLURM_CONF=conf)).stdout.strip()
        deadline = time.monotonic() + 30
        while (running := job_fields(job, conf))["JobState"] != "RUNNING":
            assert time.monotonic() < deadline, running
            time.sleep(0.2)

        status = cluster("status", settings=user)
        assert status.returncode == 0 and status.stdout.startswith("up: "), status.stdout
        assert status.stdout.rstrip().endswith("; 1 active job(s)") and "=idle" not in status.stdout

        again = cluster("start", settings=user)
        assert again.returncode == 0 and "already running" in again.stderr and \
            "1 active job(s); kept" in again.stderr, again.stderr
        other = cluster("start", "--nodes", "2", settings=user)
        assert other.returncode == 1, other.stderr
        assert other.stderr.strip().splitlines() == [
            f"[local-cluster] ERROR: running with another configuration ({conf}) and 1 active "
            "job(s) (squeue); not restarting it. Wait for them, or 'stop --force' to cancel them, "
            "or start a second cluster with its own SCSE_SLURM_DIR, SCSE_SLURM_CONF and "
            "SCSE_SLURM_PORT"]
        stop = cluster("stop", settings=user)
        assert stop.returncode == 1 and stop.stderr.strip() == (
            "[local-cluster] ERROR: 1 active job(s) (squeue); not stopping. 'stop --force' cancels "
            "them first")

        # The Slurm tests' fixture: its own cluster comes up, runs a job, and goes away.
        fixture = running_cluster(nodes=2)
        assert next(fixture) == TEST_CLUSTER["SCSE_SLURM_CONF"] == os.environ["SLURM_CONF"]
        out = subprocess.run(["srun", "--nodes=2", "hostname"], capture_output=True, text=True,
                             check=True)
        assert len(out.stdout.split()) == 2
        fixture.close()
        assert "SLURM_CONF" not in os.environ or \
            os.environ["SLURM_CONF"] != TEST_CLUSTER["SCSE_SLURM_CONF"]

        after = job_fields(job, conf)
        assert (after["JobState"], after["StartTime"], after["Restarts"]) == \
            ("RUNNING", running["StartTime"], "0"), after
        assert cluster("status", settings=user).returncode == 0
    finally:
        forced = cluster("stop", "--force", settings=user, timeout=120)
    assert forced.returncode == 0 and "cancelling 1 job(s)" in forced.stderr, forced.stderr
    down = cluster("status", settings=user)
    assert down.returncode == 1 and down.stdout.startswith("down: slurmctld is not running"), \
        down.stdout
