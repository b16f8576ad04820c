"""scse-study --slurm on a real local Slurm with CPU nodes and no --backend-args (the spec's
default resources: one node, one task, no GPU): one job array of 4 tiny runs, at most 2 of the
study's jobs at once counting evaluations and the report, each run evaluated in its own job
before the next run trains, array tasks named after their variant and seed, one run that fails
in training named in the report; a request the cluster cannot meet is refused before submitting.
The study is submitted as a user does, from an experiment directory outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime

import pytest
import yaml

from slurm_cluster import running_cluster
from test_slurm_e2e import wait_final

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_cluster():
    """The tests' one-node cluster with 4 CPUs (more than the 2 cores is fine), so that the cap,
    not the node's CPUs, is what holds runs back."""
    yield from running_cluster(nodes=1, cpus=4)


def jobs(job_ids: list[str]) -> list[dict[str, str]]:
    """`scontrol show job` of each id (an array id: one record per task)."""
    out = []
    for job in job_ids:
        text = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                              text=True, check=True).stdout
        out += [dict(f.split("=", 1) for f in line.split() if "=" in f)
                for line in text.splitlines()]
    return out


def most_at_once(records: list[dict[str, str]]) -> int:
    """The most jobs running at one time, from their start and end times (half-open)."""
    times = [(datetime.fromisoformat(t["StartTime"]), datetime.fromisoformat(t["EndTime"]))
             for t in records]
    return max(sum(s <= start < e for s, e in times) for start, _ in times)


def study(tmp_path, spec: dict, user_env: dict, *args: str) -> subprocess.CompletedProcess:
    """`cd exp && scse-study spec.yaml --slurm --max-parallel 2` as a user on the login node runs
    it, in a directory outside the checkout."""
    exp = tmp_path / "exp"
    exp.mkdir(exist_ok=True)
    path = exp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # the tests' cluster
    env = dict(user_env, WANDB_MODE="disabled", SLURM_CONF=os.environ["SLURM_CONF"])
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_TASK_ID"):
        env.pop(key, None)
    return subprocess.run(["scse-study", "spec.yaml", "--slurm", "--max-parallel", "2", *args],
                          capture_output=True, text=True, cwd=exp, env=env)


def test_slurm_study_on_cpu_nodes_caps_every_job_and_evaluates_each_run_in_its_job(
        slurm_cluster, tmp_path, tiny_config, user_env):
    from conftest import tiny_documents

    base = tiny_config(tmp_path, "train.max_steps=4", "train.checkpoint.every=4")
    (tmp_path / "wiki.txt").write_text("".join(f" = Article {i} = \n\n {doc} \n\n"
                                               for i, doc in enumerate(tiny_documents(3, seed=5))))
    spec = {"name": "arr", "out": str(tmp_path / "studies"), "base": base,
            "variants": {"scse": {"overrides": {}},
                         "additive": {"overrides": {"model.recurrence": "additive"}},
                         "looped": {"overrides": {"model.recurrence": "looped"}},
                         # valid config, but no data there and no data.build: training fails
                         "broken": {"overrides": {"data.path": str(tmp_path / "missing")}}},
            "seeds": [0], "evals": {"tasks": ["heldout", "wikitext", "diagnose"], "depths": [1, 2],
                                    "wikitext": str(tmp_path / "wiki.txt")},
            "resources": {"time_min": 10}}
    out = study(tmp_path, spec, user_env)
    assert out.returncode == 0, out.stderr
    d = tmp_path / "studies" / "arr"
    run_dirs = [d / v / f"{v}-seed0" for v in ("scse", "additive", "looped", "broken")]
    submitted = json.loads((d / "logs" / "final.json").read_text())
    assert submitted["runs"] == [str(r) for r in run_dirs]

    # --stage report, afterany on the array
    report_job = wait_final(submitted["next"], timeout_s=300)
    tasks = jobs([submitted["array"]])
    assert {t["ArrayTaskId"]: (t["JobName"], t["JobState"]) for t in tasks} == {
        "0": ("arr-scse-seed0", "COMPLETED"), "1": ("arr-additive-seed0", "COMPLETED"),
        "2": ("arr-looped-seed0", "COMPLETED"), "3": ("arr-broken-seed0", "FAILED")}, tasks
    assert all(t["ArrayTaskThrottle"] == "2" for t in tasks)
    assert all((t["NumCPUs"], t["TRES"].count("gpu")) == ("1", 0) for t in tasks)  # spec.resources
    assert all(t["WorkDir"] == str(tmp_path / "exp") for t in tasks)  # where it was submitted
    # Every job of the study (training, evaluations, the report stage) counted: 2 at once at most,
    # and with 4 CPUs free, tasks 0 and 1 ran together.
    assert most_at_once(tasks + [report_job]) == 2, [(t["StartTime"], t["EndTime"]) for t in tasks]
    # the report is written, and the broken run fails the report job (exit 1)
    assert (report_job["JobState"], report_job["ExitCode"]) == ("FAILED", "1:0"), report_job
    assert report_job["StartTime"] >= max(t["EndTime"] for t in tasks)

    # Each finished run was evaluated inside its own job, before the job ended and the next
    # pending run (task 2 after task 0 or 1) could start.
    ended = {t["ArrayTaskId"]: datetime.fromisoformat(t["EndTime"]).timestamp() for t in tasks}
    started = {t["ArrayTaskId"]: datetime.fromisoformat(t["StartTime"]).timestamp() for t in tasks}
    for i, run in enumerate(run_dirs[:3]):
        heldout = run / "eval" / "heldout.json"
        assert [r["depth"] for r in json.loads(heldout.read_text())["results"]] == [1, 2]
        assert json.loads(heldout.read_text())["checkpoint"] == f"{run.name}@export"
        assert heldout.stat().st_mtime <= ended[str(i)] + 1 and \
            (run / "eval" / "report.md").is_file()
        assert not (run / "eval" / "scheduled.json").exists()  # no separate evaluation jobs
    first_free = min(ended["0"], ended["1"])
    assert started["2"] >= first_free - 1
    assert not (run_dirs[3] / "export").exists()

    stage_log = (d / "logs" / f"{submitted['next']}_0_log.out").read_text()
    assert f"FAILED {run_dirs[3]}: training did not finish" in stage_log, stage_log
    assert "scse-study: report: -m scse_dist.study.report" in stage_log, stage_log
    text = (d / "report" / "report.md").read_text()
    assert "broken" in text and "additive" in text and "## heldout ppl" in text, text
    # the report's default metrics: WikiText's ppl, word ppl and bits per byte, each compared
    numbers = json.loads((d / "report" / "aggregate.json").read_text())
    assert {k for k in numbers["aggregate"] if k.startswith("scse/")} == {
        "scse/heldout/ppl", "scse/wikitext/ppl", "scse/wikitext/word_ppl",
        "scse/wikitext/bits_per_byte"}
    assert numbers["paired"]["scse - additive/wikitext/bits_per_byte"]["verdict"] == \
        "not resolved at 1 seed"
    assert "## wikitext bits_per_byte (lower is better)" in text
    assert not list((d / "report").glob("wandb*"))  # every run config disables wandb


def test_a_request_the_cluster_cannot_meet_is_one_line_and_submits_nothing(slurm_cluster, tmp_path,
                                                                           tiny_config, user_env):
    before = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True,
                            text=True, check=True).stdout.split()
    spec = {"name": "big", "out": str(tmp_path / "studies"), "base": tiny_config(tmp_path),
            "variants": {"scse": {"overrides": {}}}, "resources": {"nodes": 3}}
    out = study(tmp_path, spec, user_env)
    assert out.returncode == 1 and out.stderr.splitlines() == [
        "scse-study: the cluster cannot run the training jobs as requested (--nodes=3 "
        "--ntasks-per-node=1 --cpus-per-task=1; spec field resources and --backend-args): "
        "allocation failure: Requested node configuration is not available"], out.stderr
    gpu = study(tmp_path, {**spec, "resources": {"gpus_per_node": 1}}, user_env)
    assert gpu.returncode == 1 and len(gpu.stderr.splitlines()) == 1, gpu.stderr
    assert "--gpus-per-node=1" in gpu.stderr and \
        "Invalid generic resource (gres) specification" in gpu.stderr
    after = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert after == before and not (tmp_path / "studies" / "big" / "logs" / "final.json").exists()


def test_slurm_two_stage_lr_sweep_submits_stage_two_after_the_choice(slurm_cluster, tmp_path,
                                                                     tiny_config, user_env):
    from conftest import tiny_documents

    base = tiny_config(tmp_path, "train.max_steps=3", "train.checkpoint.every=3")
    (tmp_path / "valid.txt").write_text("\n\n".join(tiny_documents(6, seed=3)))
    spec = {"name": "two", "out": str(tmp_path / "studies"), "base": base,
            "variants": {"scse": {"overrides": {}}}, "seeds": [4],
            "lr": {"values": [1e-4, 3e-3], "validation": str(tmp_path / "valid.txt")},
            "evals": {"tasks": ["heldout"], "depths": [1]}}
    out = study(tmp_path, spec, user_env)
    assert out.returncode == 0, out.stderr
    d = tmp_path / "studies" / "two"
    sweep = json.loads((d / "logs" / "sweep.json").read_text())
    assert len(sweep["runs"]) == 2 and not (d / "lr_choice.json").exists()
    stage2 = wait_final(sweep["next"], timeout_s=240)  # the job that chooses and submits stage 2
    assert (stage2["JobState"], stage2["JobName"]) == ("COMPLETED", "two-choose-lr")
    # the sweep runs were not evaluated on the test tasks; the stage-2 job scored them
    assert not list(d.glob("scse/scse-lr*-seed0/eval/heldout.json"))
    choice = json.loads((d / "lr_choice.json").read_text())["scse"]
    assert set(choice["scores"]) == {"0.0001", "0.003"} and choice["failed"] == []
    final = json.loads((d / "logs" / "final.json").read_text())
    assert final["runs"] == [str(d / "scse" / "scse-seed4")]
    assert wait_final(final["next"], timeout_s=240)["JobState"] == "COMPLETED"
    # stage 2 started only after the job that submitted it ended: never beside it
    (task,) = jobs([final["array"]])
    assert task["StartTime"] >= stage2["EndTime"] and task["JobName"] == "two-scse-seed4"
    cfg = yaml.safe_load((d / "scse" / "scse-seed4" / "config.yaml").read_text())
    assert cfg["train"]["optimizer"]["lr"] == choice["lr"] and cfg["train"]["seed"] == 4
    assert (d / "scse" / "scse-seed4" / "export" / "model.safetensors").is_file()
    assert (d / "scse" / "scse-seed4" / "eval" / "heldout.json").is_file()
