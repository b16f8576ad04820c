"""A real single-node Slurm (slurm/local-cluster.sh): `sbatch slurm/pretrain.sh CONFIG key=value`,
submitted from a directory outside the checkout with the package installed as a wheel (no
checkout on the path), trains at world size 2 (two tasks, gloo), and the evaluation jobs it
schedules run after it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from slurm_cluster import running_cluster
from test_slurm_e2e import logs, scheduled, wait_final

pytestmark = pytest.mark.slow
PRETRAIN = str(REPO_ROOT / "slurm" / "pretrain.sh")
# the one-node test cluster has no GPUs: sbatch's own flags override the script's defaults
TWO_CPU_TASKS = ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]


@pytest.fixture(scope="module")
def slurm_cluster():
    yield from running_cluster(nodes=1)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """The environment of a user whose scse-dist is a non-editable install: the package built and
    installed into a directory of its own, first on the path; the venv's python on PATH."""
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-build-isolation", "--target", str(site), str(REPO_ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(site),
               OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    where = subprocess.run([sys.executable, "-c", "import scse_dist; print(scse_dist.__file__)"],
                           capture_output=True, text=True, env=env, cwd=site, check=True).stdout
    assert where.startswith(str(site)), where
    return env


def sbatch(cwd: Path, env: dict, *args: str) -> str:
    """`sbatch ... slurm/pretrain.sh ARGS` run in `cwd`; the job id."""
    out = subprocess.run(["sbatch", "--parsable", *TWO_CPU_TASKS, PRETRAIN, *args],
                         capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def elsewhere_config(tmp_path: Path, tiny_config, *overrides: str) -> Path:
    """The run config as `tiny.yaml` in a directory of the user's, outside the checkout."""
    home = tmp_path / "elsewhere"
    home.mkdir()
    (home / "tiny.yaml").write_text(Path(tiny_config(tmp_path, *overrides)).read_text())
    return home


def test_pretrain_sh_trains_then_evaluates_from_any_directory(slurm_cluster, tmp_path,
                                                              tiny_config, wheel_env):
    home = elsewhere_config(tmp_path, tiny_config, "train.max_steps=12",
                            "train.checkpoint.every=5", "eval.tasks=[heldout,diagnose]")
    # the config by a path relative to the submit directory; an override on the command line
    train = sbatch(home, wheel_env, "tiny.yaml", "name=wrapped")
    run_dir = tmp_path / "runs" / "wrapped"
    ids = scheduled(run_dir)
    assert ids["train_job"] == train and set(ids["eval_jobs"]) == {"heldout", "diagnose"}
    trained = wait_final(train, timeout_s=240)
    out = logs(tmp_path)
    batch_log = (run_dir / "logs" / f"{train}_batch.out").read_text()
    assert trained["JobState"] == "COMPLETED", (trained, batch_log, out)
    assert trained["WorkDir"] == str(home) and trained["JobName"] == "scse-pretrain"
    assert f"pretrain.sh: job {train} (start 1) on" in batch_log
    assert batch_log.rstrip().endswith("pretrain.sh: training exited 0"), batch_log
    # nothing went wrong before the run dir was known: the submit dir's file stays empty
    assert (home / f"slurm-scse-pretrain-{train}.out").read_text() == ""
    assert out.count("world 2 (slurm)") == 1, out

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r and r.get("kind", "train") == "train"]
    assert train_rows[-1]["step"] == 12
    assert all(math.isfinite(r["loss"]) for r in train_rows)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000012"
    assert (run_dir / "export" / "model.safetensors").stat().st_size > 0
    for job in [*ids["eval_jobs"].values(), ids["report_job"]]:
        info = wait_final(job)
        assert info["JobState"] == "COMPLETED", (info, logs(tmp_path))
        assert info["StartTime"] >= trained["EndTime"]  # afterok held them until training ended
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2]
    assert all(math.isfinite(r["ppl"]) and 1 < r["ppl"] < 512 for r in heldout["results"])
    assert (run_dir / "eval" / "report.md").is_file()


def test_pretrain_sh_with_a_bad_config_fails_in_one_line(slurm_cluster, tmp_path, wheel_env):
    home = tmp_path / "elsewhere"
    home.mkdir()
    job = sbatch(home, wheel_env, "missing.yaml")
    assert wait_final(job)["JobState"] == "FAILED"
    assert (home / f"slurm-scse-pretrain-{job}.out").read_text() == \
        "scse-launch: config error: config file 'missing.yaml' does not exist\n"
