"""How fast each command answers when it has nothing heavy to do: `--help` of every console script
(and `python launch/train.py`), and a few bad inputs that are rejected before any model exists.

    python benchmarks/bench_cli_start.py [--repeat 5]

Prints, per command, the median wall time and CPU time (user + sys of the process) over the
repeats, and whether the process imported torch or DeepSpeed. CPU time is the steadier number on
a shared machine (wall time there depends on what else runs). Run it from the repository root
with the environment the commands run in (the venv active, PYTHONPATH set for a checkout).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def script(name: str) -> list[str]:
    """Console script `name` as its entry point run by this interpreter: what the installed script
    does, also where an editable install predates a moved entry point."""
    module, func = SCRIPTS[name].split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def cases(tmp: str) -> list[tuple[str, list[str]]]:
    """(label, argv) of every case: each command's --help, then bad inputs (files under tmp)."""
    train = [sys.executable, str(REPO / "launch" / "train.py")]
    rows = [(f"{name} --help", [*script(name), "--help"]) for name in sorted(SCRIPTS)]
    rows.append(("launch/train.py --help", [*train, "--help"]))
    bad = Path(tmp) / "bad.jsonl"
    bad.write_text('{"text": \n')
    rows += [
        ("scse-data shards: missing tokenizer",
         [*script("scse-data"), "shards", "--input", str(bad), "--tokenizer",
          f"{tmp}/missing.model", "--out", f"{tmp}/s"]),
        ("scse-eval: missing --checkpoint",
         [*script("scse-eval"), "--checkpoint", f"{tmp}/missing", "--task", "lambada", "--out",
          f"{tmp}/r.json"]),
        ("scse-export: missing checkpoint",
         [*script("scse-export"), f"{tmp}/missing", "--out", f"{tmp}/x"]),
        ("launch/train.py: missing data.path",
         [*train, "--config", str(REPO / "configs/tiny-cpu.yaml"), "data.build=null",
          f"data.path={tmp}/missing"]),
    ]
    return rows


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float, bool]:
    """(wall s, CPU s, whether torch or deepspeed was imported) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO,
                          env=dict(env, PYTHONPROFILEIMPORTTIME="1"))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    heavy = any(line.rsplit("|", 1)[-1].strip() in ("torch", "deepspeed")
                for line in proc.stderr.splitlines() if line.startswith("import time:"))
    return wall, cpu, heavy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"| command | wall s (median of {args.repeat}) | CPU s | imports torch/deepspeed |")
    print("|---|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, argv in cases(tmp):
            runs = [measure(argv, env) for _ in range(args.repeat)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"| {label} | {wall:.2f} | {cpu:.2f} | {'yes' if runs[0][2] else 'no'} |",
                  flush=True)


if __name__ == "__main__":
    main()
