"""The Slurm tests' own local cluster (slurm/local-cluster.sh), apart from any cluster a user runs.

It has its own state dir, slurm.conf and ports (TEST_CLUSTER), so starting, reconfiguring or
stopping it never touches the default cluster (/etc/slurm/slurm.conf, /tmp/scse-slurm) or its
jobs. While a test module uses it, os.environ["SLURM_CONF"] points every client command (sbatch,
squeue, scontrol, scancel) and the jobs they submit at it. SCSE_TEST_SLURM_DIR and
SCSE_TEST_SLURM_PORT move it (default /tmp/scse-slurm-tests, slurmctld on 6960, slurmds above).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

CLUSTER_SCRIPT = ["bash", str(REPO_ROOT / "slurm" / "local-cluster.sh")]
_TEST_DIR = os.environ.get("SCSE_TEST_SLURM_DIR", "/tmp/scse-slurm-tests")
TEST_CLUSTER = {"SCSE_SLURM_DIR": _TEST_DIR, "SCSE_SLURM_CONF": f"{_TEST_DIR}/etc/slurm.conf",
                "SCSE_SLURM_PORT": os.environ.get("SCSE_TEST_SLURM_PORT", "6960")}


def cluster(command: str, *args: str, settings: dict[str, str], cpus: int | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """`local-cluster.sh COMMAND ARGS` for the cluster that `settings` (SCSE_SLURM_*) names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCSE_SLURM_", "SLURM_"))}
    env.update(settings)
    if cpus is not None:
        env["SCSE_SLURM_CPUS"] = str(cpus)
    return subprocess.run([*CLUSTER_SCRIPT, command, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def skip_without_slurm() -> None:
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (slurmd runs as root)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no Slurm packages and no apt-get to install them")


def running_cluster(nodes: int, cpus: int | None = None, settings: dict[str, str] = TEST_CLUSTER):
    """A module fixture's body: the tests' cluster with `nodes` nodes (`cpus` CPUs each) while the
    module runs, SLURM_CONF pointing at it. Afterwards it is stopped, with any test job left, unless
    it was running before (then it is left as it is)."""
    skip_without_slurm()
    before = cluster("status", settings=settings)
    start = cluster("start", "--nodes", str(nodes), settings=settings, cpus=cpus)
    assert start.returncode == 0, start.stderr[-3000:]
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = settings["SCSE_SLURM_CONF"]
    try:
        yield settings["SCSE_SLURM_CONF"]
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        if before.returncode != 0:
            cluster("stop", "--force", settings=settings, timeout=120)
