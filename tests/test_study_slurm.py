"""scse-study --slurm on a real local Slurm: one job array of 4 tiny runs capped at 2 at once,
each run's evaluation jobs after it, one run that fails in training, and the study report job
afterwards, which names the failed run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime

import pytest
import yaml

from conftest import REPO_ROOT
from slurm_cluster import running_cluster
from test_slurm_e2e import job_info, wait_final

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_cluster():
    """The tests' one-node cluster with 4 CPUs (more than the 2 cores is fine), so that the cap,
    not the node's CPUs, is what holds runs back."""
    yield from running_cluster(nodes=1, cpus=4)


def node_cpus() -> int:
    out = subprocess.run(["scontrol", "-o", "show", "node"], capture_output=True, text=True, check=True)
    return int(re.search(r"CPUTot=(\d+)", out.stdout).group(1))


def array_tasks(array_id: str) -> list[dict[str, str]]:
    out = subprocess.run(["scontrol", "-o", "show", "job", array_id], capture_output=True, text=True,
                         check=True).stdout
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines()]


def most_at_once(tasks: list[dict[str, str]]) -> int:
    """The most tasks running at one time, from their start and end times (half-open)."""
    times = [(datetime.fromisoformat(t["StartTime"]), datetime.fromisoformat(t["EndTime"])) for t in tasks]
    return max(sum(s <= start < e for s, e in times) for start, _ in times)


def submit_study(tmp_path, spec: dict, user_env: dict) -> None:
    """`scse-study SPEC --slurm --max-parallel 2` as a user on the login node runs it."""
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = dict(user_env, WANDB_MODE="disabled", SLURM_CONF=os.environ["SLURM_CONF"])  # the tests' cluster
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_TASK_ID"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "scse_dist.study.cli", str(path), "--slurm",
                          "--max-parallel", "2", "--sbatch-args",
                          "--nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --gpus-per-node=0 --time=10"],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=env)
    assert out.returncode == 0, out.stderr


def test_slurm_study_array_capped_failure_named_and_report_after(slurm_cluster, tmp_path, tiny_config,
                                                                 user_env):
    base = tiny_config(tmp_path, "train.max_steps=4", "train.checkpoint_every=4")
    spec = {"name": "arr", "out": str(tmp_path / "studies"), "base": base,
            "variants": {"scse": {"overrides": {}},
                         "additive": {"overrides": {"model.recurrence": "additive"}},
                         "looped": {"overrides": {"model.recurrence": "looped"}},
                         # valid config, but no data there and no data.build: training fails
                         "broken": {"overrides": {"data.path": str(tmp_path / "missing")}}},
            "seeds": [0], "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    submit_study(tmp_path, spec, user_env)
    d = tmp_path / "studies" / "arr"
    submitted = json.loads((d / "slurm" / "final.json").read_text())
    assert len(submitted["runs"]) == 4
    assert (d / "configs-final.txt").read_text().splitlines() == [
        str(d / v / "seed0" / "config.yaml") for v in ("scse", "additive", "looped", "broken")]

    after = wait_final(submitted["next"], timeout_s=240)  # the report stage, afterany on the array
    tasks = array_tasks(submitted["array"])
    states = {t["JobName"] and t["ArrayTaskId"]: t["JobState"] for t in tasks}
    assert states == {"0": "COMPLETED", "1": "COMPLETED", "2": "COMPLETED", "3": "FAILED"}, tasks
    assert all(t["ArrayTaskThrottle"] == "2" for t in tasks)
    # With 4 CPUs free, tasks 0 and 1 start together and the cap alone keeps 2 and 3 waiting.
    at_once = most_at_once(tasks)
    assert at_once == 2 if node_cpus() >= 4 else at_once <= 2, [(t["StartTime"], t["EndTime"]) for t in tasks]
    assert after["JobState"] == "COMPLETED"
    assert after["StartTime"] >= max(t["EndTime"] for t in tasks)
    stage_log = next((d / "slurm").glob("arr-report-*.out")).read_text()
    assert f"FAILED {d / 'broken' / 'seed0'}: training did not finish" in stage_log, stage_log

    # Each finished run's evaluation job followed its training (afterok), as with pretrain.sh.
    for variant in ("scse", "additive", "looped"):
        ids = json.loads((d / variant / "seed0" / "eval" / "scheduled.json").read_text())
        assert wait_final(ids["eval_jobs"]["heldout"])["JobState"] == "COMPLETED"
        heldout = json.loads((d / variant / "seed0" / "eval" / "heldout.json").read_text())
        assert [r["depth"] for r in heldout["results"]] == [1, 2]
    assert not (d / "broken" / "seed0" / "export").exists()

    # The study report job: afterany on the evaluations still queued, or run by the stage job.
    match = re.search(r"study report job (\d+)", stage_log)
    if match:
        report = wait_final(match.group(1), timeout_s=120)
        assert report["JobState"] in ("COMPLETED", "FAILED"), report  # it ran, after the evaluations
        evals = [json.loads((d / v / "seed0/eval/scheduled.json").read_text())["eval_jobs"]["heldout"]
                 for v in ("scse", "additive", "looped")]
        assert report["StartTime"] >= max(job_info(j)["EndTime"] for j in evals)
        report_out = (d / "slurm" / f"arr-study-report-{match.group(1)}.out").read_text()
    else:  # every evaluation had ended already: the stage job ran the report itself
        assert "scse-study: report: -m scse_dist.study.report" in stage_log, stage_log
        report_out = stage_log
    if match:
        assert report["JobState"] == "COMPLETED", report_out
    text = (d / "report" / "report.md").read_text()
    assert "broken" in text and "additive" in text, text


def test_slurm_two_stage_lr_sweep_submits_stage_two_after_the_choice(slurm_cluster, tmp_path,
                                                                     tiny_config, user_env):
    from conftest import tiny_documents

    base = tiny_config(tmp_path, "train.max_steps=3", "train.checkpoint_every=3")
    (tmp_path / "valid.txt").write_text("\n\n".join(tiny_documents(6, seed=3)))
    spec = {"name": "two", "out": str(tmp_path / "studies"), "base": base,
            "variants": {"scse": {"overrides": {}}}, "seeds": [4],
            "lr": {"values": [1e-4, 3e-3], "validation": str(tmp_path / "valid.txt")},
            "evals": {"tasks": ["heldout"], "depths": [1]}}
    submit_study(tmp_path, spec, user_env)
    d = tmp_path / "studies" / "two"
    sweep = json.loads((d / "slurm" / "sweep.json").read_text())
    assert len(sweep["runs"]) == 2 and not (d / "lr_choice.json").exists()
    assert wait_final(sweep["next"], timeout_s=240)["JobState"] == "COMPLETED"  # stage-2 submit job
    # the sweep runs scheduled no evaluation jobs of their own; the stage-2 job scored them
    assert not list(d.glob("scse/lr*/seed0/eval/scheduled.json"))
    choice = json.loads((d / "lr_choice.json").read_text())["scse"]
    assert set(choice["scores"]) == {"0.0001", "0.003"} and choice["failed"] == []
    final = json.loads((d / "slurm" / "final.json").read_text())
    assert final["runs"] == [str(d / "scse" / "seed4")]
    assert wait_final(final["next"], timeout_s=240)["JobState"] == "COMPLETED"
    cfg = yaml.safe_load((d / "scse" / "seed4" / "config.yaml").read_text())
    assert cfg["train"]["lr"] == choice["lr"] and cfg["train"]["seed"] == 4
    assert (d / "scse" / "seed4" / "export" / "model.safetensors").is_file()
