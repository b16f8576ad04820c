"""Launcher environments -> DistEnv, for deepspeed/torchrun, srun and none."""

import os
import subprocess
import sys
import textwrap

import pytest

from scse_dist.distributed import (
    SLURM_PORT_BASE,
    DistEnv,
    describe_placement,
    resolve_dist_env,
    slurm_first_host,
)


def test_deepspeed_and_torchrun_env_is_taken_as_is():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7",
           "MASTER_PORT": "29612", "TORCHELASTIC_RUN_ID": "x"}
    assert resolve_dist_env(env) == DistEnv(3, 8, 1, "10.0.0.7", 29612, "env")


def test_launcher_env_wins_over_slurm_env():
    # torchrun inside an srun step: torchrun's RANK is per process, SLURM_PROCID per node.
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
           "MASTER_PORT": "1234", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "77"}
    assert resolve_dist_env(env).rank == 5


def test_srun_maps_slurm_vars_and_derives_port_from_job_id():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
           "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-06]", "SLURM_JOB_ID": "123456"}
    seen = []
    got = resolve_dist_env(env, first_host=lambda nodes: seen.append(nodes) or "gpu03")
    assert got == DistEnv(5, 8, 1, "gpu03", SLURM_PORT_BASE + 123456 % 20000, "slurm")
    assert seen == ["gpu[03-06]"]


def test_srun_respects_explicit_master_addr_and_port():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "a[1-2]", "SLURM_JOB_ID": "9", "MASTER_ADDR": "head",
           "MASTER_PORT": "4000"}
    got = resolve_dist_env(env, first_host=lambda nodes: pytest.fail("scontrol must not run"))
    assert (got.master_addr, got.master_port, got.world_size) == ("head", 4000, 2)


def test_placement_names_the_slurm_task_and_node():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1",
           "SLURMD_NODENAME": "vnode2", "SLURM_JOB_NODELIST": "vnode[1-2]", "SLURM_JOB_ID": "9"}
    line = describe_placement(resolve_dist_env(env, first_host=lambda nodes: "vnode1"), env)
    assert line.startswith("rank 1 of 2 (local rank 0) on ")
    assert line.endswith(", Slurm task 1 on node vnode2 (SLURM_NODEID 1), rendezvous "
                         "vnode1:20009 (slurm)")
    plain = describe_placement(DistEnv(0, 2, 0, "127.0.0.1", 4000, "env"), {})
    assert "Slurm" not in plain and plain.endswith("rendezvous 127.0.0.1:4000 (env)")


def test_sbatch_shell_without_srun_is_single_process():
    # The batch script itself has SLURM_NTASKS=8 but is one process: it must not wait for 7 peers.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_ID": "3"}
    got = resolve_dist_env(env)
    assert (got.rank, got.world_size, got.launcher) == (0, 1, "none")


def test_no_launcher_is_rank0_of_1_on_a_free_local_port():
    got = resolve_dist_env({})
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.launcher) == \
        (0, 1, 0, "127.0.0.1", "none")
    assert 1024 <= got.master_port < 65536
    assert got.as_environ()["MASTER_PORT"] == str(got.master_port)


def test_bad_integer_names_the_variable():
    with pytest.raises(RuntimeError, match="SLURM_PROCID='x'"):
        resolve_dist_env({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2",
                          "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "1"})


def test_srun_rendezvous_is_the_first_host_of_the_node_list(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere: none is needed
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "42"}
    got = resolve_dist_env(env)
    assert (got.rank, got.world_size, got.master_addr) == (1, 2, "node07")
    # the step's own node list first, when srun ran on part of the allocation
    assert resolve_dist_env({**env, "SLURM_STEP_NODELIST": "node08"}).master_addr == "node08"


@pytest.mark.parametrize("nodelist, first", [
    ("single-host", "single-host"), ("gpu[03-06],cpu1", "gpu03"), ("a1,b[2-3]", "a1"),
    ("vnode[1-2]", "vnode1"), ("n[009-011]", "n009")])
def test_first_host_of_a_node_list(nodelist, first):
    assert slurm_first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["n[1-", "x[a-b]", ""])
def test_a_node_list_that_does_not_parse_asks_for_master_addr(nodelist):
    with pytest.raises(RuntimeError) as err:
        slurm_first_host(nodelist)
    assert str(err.value) == f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm node list; set " \
        "MASTER_ADDR"


def test_init_distributed_without_launcher_starts_a_gloo_group_of_one():
    code = textwrap.dedent("""\
        import os, torch.distributed as dist
        from scse_dist.distributed import init_distributed, shutdown
        env = init_distributed()
        t = __import__('torch').ones(1); dist.all_reduce(t)
        print(env.rank, env.world_size, dist.get_backend(), float(t), os.environ['WORLD_SIZE'])
        shutdown()
        """)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-5:] == ["0", "1", "gloo", "1.0", "1"]
