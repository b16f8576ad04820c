"""Helpers for tests that run the trainer (or a worker) as real processes, one per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scse_dist.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def tail(self) -> str:
        return f"rank {self.rank} rc={self.returncode}\n{self.stdout[-2500:]}\n" \
            f"{self.stderr[-2500:]}"


def run_ranks(args: list[str], env: dict, world: int = 2, timeout: int = 240,
              extra_env: dict | None = None) -> list[RankResult]:
    """Start `python args...` once per rank with the env a torchrun/deepspeed launcher would set."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(RankResult(rank, proc.returncode, out, err))
    return results


def train_ranks(config: str, env: dict, *overrides: str, world: int = 2,
                extra_env: dict | None = None, timeout: int = 240) -> list[RankResult]:
    return run_ranks([TRAIN, "--config", config, *overrides], env, world, timeout, extra_env)


def all_passed(results: list[RankResult]) -> str:
    for r in results:
        assert r.returncode == 0, r.tail()
    return results[0].stdout


def run_trainer(config: str, env: dict, *overrides: str) -> str:
    """One training process (world size 1) to completion; its stdout. A failure shows both tails."""
    out = subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
