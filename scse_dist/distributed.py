"""One code path from any launcher's environment to an initialised process group.

`deepspeed` and `torchrun` export RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; `srun` exports
SLURM_* instead; a plain `python launch/train.py` exports nothing and is rank 0 of 1.
`resolve_dist_env` maps all of them to one `DistEnv` (pure apart from asking the OS for a free
port); `init_distributed` exports it and starts the group. Under srun the first host of the node
list is submitit's reading of it. submitit's TorchDistributedEnvironment is not used: it needs a
job submitit started (slurm/pretrain.sh's srun is not), takes the world size from SLURM_NTASKS
(a batch shell that runs python itself would wait for peers), and draws another port.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

# Collective timeout: a dead peer makes the others fail after this long instead of hanging forever.
DEFAULT_TIMEOUT_S = 600
TIMEOUT_ENV = "SCSE_DIST_TIMEOUT_S"
# Slurm jobs without MASTER_PORT derive a port from the job id: every task agrees without talking.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "env" (deepspeed/torchrun), "slurm" or "none"

    def as_environ(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slurm_first_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gpu[03-06],cpu1``, read by the parser behind
    submitit's SlurmJobEnvironment.hostnames (no scontrol)."""
    from submitit.slurm.slurm import SlurmParseException, _parse_node_list

    try:
        hosts = _parse_node_list(nodelist)
    except SlurmParseException:
        hosts = []
    if not hosts:
        raise RuntimeError(f"SLURM_JOB_NODELIST={nodelist!r}: not a Slurm node list; set "
                           "MASTER_ADDR")
    return hosts[0]


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise RuntimeError(f"environment {key}={environ[key]!r} is not an integer") from None


def launcher_world(environ: Mapping[str, str]) -> tuple[int, str]:
    """The world size a launcher's environment gives, and where it comes from ("from
    WORLD_SIZE": what a global batch that does not divide names), without starting anything."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _int(environ, "WORLD_SIZE"), "from WORLD_SIZE"
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return _int(environ, "SLURM_STEP_NUM_TASKS"), "from SLURM_STEP_NUM_TASKS"
    return 1, "one process, no launcher"


def resolve_dist_env(environ: Mapping[str, str],
                     first_host: Callable[[str], str] = slurm_first_host) -> DistEnv:
    """Map a launcher's environment to rank, world size, local rank and rendezvous address."""
    world_size, source = launcher_world(environ)
    if source == "from WORLD_SIZE":  # deepspeed launcher, torchrun
        return DistEnv(rank=_int(environ, "RANK"), world_size=world_size,
                       local_rank=_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0,
                       master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ
                       else 29500, launcher="env")
    # srun: SLURM_STEP_NUM_TASKS exists only inside a job step; an sbatch shell that runs python
    # directly has SLURM_NTASKS of the whole allocation but only one process, so it is rank 0 of 1.
    if source == "from SLURM_STEP_NUM_TASKS":
        addr = environ["MASTER_ADDR"] if "MASTER_ADDR" in environ else \
            first_host(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
        port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else \
            SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN
        return DistEnv(rank=_int(environ, "SLURM_PROCID"),
                       world_size=world_size,
                       local_rank=_int(environ, "SLURM_LOCALID")
                       if "SLURM_LOCALID" in environ else 0,
                       master_addr=addr, master_port=port, launcher="slurm")
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ
                   else free_port(), launcher="none")


def describe_placement(env: DistEnv, environ: Mapping[str, str]) -> str:
    """Where this rank runs, for the log; under Slurm also its task and node (a multi-node log then
    shows that every task started, and on which node)."""
    where = f"rank {env.rank} of {env.world_size} (local rank {env.local_rank}) on " \
        f"{socket.gethostname()}"
    if env.launcher == "slurm":
        where += (f", Slurm task {environ.get('SLURM_PROCID', '?')} on node "
                  f"{environ.get('SLURMD_NODENAME', '?')} "
                  f"(SLURM_NODEID {environ.get('SLURM_NODEID', '?')})")
    return f"{where}, rendezvous {env.master_addr}:{env.master_port} ({env.launcher})"


def collective_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        return float(raw)
    except ValueError:
        raise RuntimeError(f"environment {TIMEOUT_ENV}={raw!r} is not a number of "
                           "seconds") from None


_STARTED: dict[str, DistEnv] = {}  # the env the running process group was started with


def init_distributed(backend: Optional[str] = None) -> DistEnv:
    """Export the resolved env, start the process group (nccl on CUDA, else gloo), return the
    env; once started (the data step starts it before train()), the env it started with."""
    if dist.is_initialized() and "env" in _STARTED:  # the exported env would read as "env"
        return _STARTED["env"]
    env = resolve_dist_env(os.environ)
    os.environ.update(env.as_environ())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    _skip_deepspeed_shm_build()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size,
                                timeout=timedelta(seconds=collective_timeout_s()))
    _STARTED["env"] = env
    return env


def _skip_deepspeed_shm_build() -> None:
    # DeepSpeed JIT-builds the `deepspeed_shm_comm` op (inference all-reduce only) on every rank
    # at start-up; marking it incompatible in `__compatible_ops__` skips the build, no patching.
    from scse_dist.quiet import name_cpu_accelerator

    name_cpu_accelerator()  # the first DeepSpeed import of a training process
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def local_rank() -> int:
    """This process's rank on its node (init_distributed exports LOCAL_RANK for every launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def abandon() -> None:
    """Destroy the process group after a start-up error, without a barrier: the error may be
    this rank's alone, and a barrier would wait for peers that never come. Left alive, gloo's
    threads sometimes abort the exiting interpreter ("terminate called without an active
    exception", exit -6 instead of the error's status)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown(engine: object | None = None) -> None:
    """Tear down in the order that avoids gloo's abort at interpreter exit (pytorch #190489)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
