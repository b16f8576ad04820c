"""The scheduler backend protocol: a study goes through it only (a recording backend sees the
arrays, caps, dependencies and checks it asks for), Slurm's flags are what the study submitted
before the protocol, and the local backend runs real jobs here in dependency order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from recording_backend import RecordingBackend
from scse_dist.launch.backends import BackendError, Job, LocalBackend, Resources, SlurmBackend, Task
from scse_dist.launch.backends.slurm import flag_parameters, resource_parameters
from scse_dist.study import execute
from scse_dist.study.plan import StudyError
from scse_dist.study.spec import parse_spec


def spec_with_sweep(tmp_path, tiny_config, **fields):
    spec = {"name": "s", "out": str(tmp_path / "studies"), "base": tiny_config(tmp_path),
            "variants": {"scse": {"overrides": {}},
                         "looped": {"overrides": {"model.recurrence": "looped"}}},
            "seeds": [0, 1], "lr": {"values": [1e-3, 3e-3], "validation": "v.txt"},
            "resources": {"gpus_per_node": 2, "time_min": 30}, **fields}
    return parse_spec(spec, str(tmp_path / "spec.yaml"))


def test_a_study_stage_is_one_checked_capped_array_then_a_job_after_it(tmp_path, tiny_config,
                                                                      monkeypatch):
    spec = spec_with_sweep(tmp_path, tiny_config)
    backend = RecordingBackend(current="7")
    monkeypatch.setenv("SCSE_STUDY_STAGE_JOB", "1")  # submitted by a stage job: after it
    ids = execute.submit_stage(spec, "sweep", 3, backend, ["--account=me"], ["SPEC", "--backend=x"])
    assert backend.kinds() == ["check", "array", "submit"]
    (_, checked), (_, array, tasks, cap, array_id), (_, nxt, next_id) = backend.calls
    assert checked == array and cap == 3
    runs = [tmp_path / f"studies/s/{v}/{v}-lr{r}-seed0" for v in ("scse", "looped")
            for r in ("0.001", "0.003")]  # 2 variants x 2 rates at lr.seed
    # every task: the installed training entry point on its run's config, no evaluation (sweep)
    assert tasks == [Task([sys.executable, "-m", "scse_dist.launch.run_job", "train",
                           str((r / "config.yaml").resolve())], f"s-{r.name}") for r in runs]
    assert array.resources == Resources(gpus_per_node=2, time_min=30)  # the spec's resources:
    assert (array.after, array.dependency, array.backend_args) == \
        (["7"], "afterany", ["--account=me"])
    assert array.log_dir == (spec.study_dir / "logs").resolve() and array.env == {}
    assert (nxt.after, nxt.dependency, nxt.name) == ([array_id], "afterany", "s-choose-lr")
    assert nxt.command[-4:] == ["SPEC", "--backend=x", "--stage", "final"]
    assert nxt.env == {"SCSE_STUDY_STAGE_JOB": "1"}
    assert ids == {"stage": "sweep", "array": array_id, "next": next_id,
                   "runs": list(map(str, runs))}
    assert json.loads((spec.study_dir / "logs" / "sweep.json").read_text()) == ids


def test_the_final_stage_evaluates_inside_each_training_job(tmp_path, tiny_config):
    spec = spec_with_sweep(tmp_path, tiny_config, lr=None)
    backend = RecordingBackend()
    execute.submit_stage(spec, "final", 2, backend, [], [])
    (_, _), (_, array, tasks, _, _), _ = backend.calls
    assert [t.command[-1] for t in tasks] == ["--evaluate"] * 4 and array.after == []


def test_a_refused_request_is_one_line_naming_it_and_submits_nothing(tmp_path, tiny_config):
    spec = spec_with_sweep(tmp_path, tiny_config)
    backend = RecordingBackend(refuse="Requested node configuration is not available")
    with pytest.raises(StudyError) as err:
        execute.run_submitted(spec, "auto", 2, backend, ["--x"], [])
    assert str(err.value) == ("the cluster cannot run the training jobs as requested (nodes=1 "
                              "gpus=2 --x; spec field resources and --backend-args): Requested "
                              "node configuration is not available")
    assert backend.kinds() == ["check"]


def test_a_refused_next_job_cancels_the_array(tmp_path, tiny_config):
    spec = spec_with_sweep(tmp_path, tiny_config)
    backend = RecordingBackend(fail_submit_at=0)
    with pytest.raises(StudyError, match="queue is full"):
        execute.run_submitted(spec, "sweep", 2, backend, [], [])
    assert backend.kinds() == ["check", "array", "cancel"] and \
        backend.calls[-1] == ("cancel", "100")


def test_a_new_backend_is_one_class_and_its_name_and_both_commands_use_it(tmp_path, tiny_config,
                                                                         monkeypatch, capsys):
    """docs/architecture.md's recipe: a Backend subclass (here the recording one) and its name in
    BACKENDS; scse-study and scse-launch take it by --backend, and current_backend() finds its
    job, unchanged."""
    from scse_dist.launch import backends, scheduler
    from scse_dist.study import cli

    class Toy(RecordingBackend):
        name = "toy"

    backend = Toy()
    monkeypatch.setitem(backends.BACKENDS, "toy", lambda: backend)
    spec = {"name": "toy", "out": str(tmp_path / "studies"), "base": tiny_config(tmp_path),
            "variants": {"scse": {"overrides": {}}}, "seeds": [0, 1]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert cli.main([str(tmp_path / "spec.yaml"), "--backend", "toy", "--max-parallel", "1"]) == 0
    assert backend.kinds() == ["check", "array", "submit"] and len(backend.calls[1][2]) == 2
    assert scheduler.main([tiny_config(tmp_path), "--backend", "toy"]) == 0
    assert backend.calls[-1][1].command[-1] == "--schedule-evals=toy"  # evals: jobs after it
    assert capsys.readouterr().out.splitlines()[-1] == backend.calls[-1][2]
    # Inside one of its jobs, crash retries (launch.retries) find it with no other edit.
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SCSE_LOCAL_JOB_ID", raising=False)
    assert backends.current_backend() is None
    backend.current = "7"
    assert backends.current_backend() == (backend, "7")


def test_slurm_jobs_are_submitit_parameters(tmp_path):
    """What the Slurm backend hands submitit: resources, the dependency, the preemption signal and
    requeue, the array cap, then --backend-args (which win); the request as sbatch flags."""
    res = Resources(nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8, time_min=60,
                    partition="gpu", mem="8G")
    assert resource_parameters(res) == {"nodes": 2, "ntasks_per_node": 4, "cpus_per_task": 8,
                                        "time": 60, "gpus_per_node": 4, "partition": "gpu",
                                        "mem": "8G"}
    # nothing asked: no GPUs, no time limit (the cluster's), its default partition and memory
    assert resource_parameters(Resources()) == {"nodes": 1, "ntasks_per_node": 1,
                                                "cpus_per_task": 1, "time": None}
    job = Job(command=["x"], name="s-final", resources=Resources(), log_dir=Path("/logs"),
              after=["7", "8"], dependency="afterany", backend_args=["--account=me", "--time=5",
                                                                      "--exclusive"])
    assert SlurmBackend().parameters(job, array_parallelism=2) == {
        "nodes": 1, "ntasks_per_node": 1, "cpus_per_task": 1, "time": None, "job_name": "s-final",
        "array_parallelism": 2, "srun_args": ["--kill-on-bad-exit=1"],
        "additional_parameters": {"signal": "USR1@120", "requeue": True,
                                  "dependency": "afterany:7:8", "account": "me", "time": "5",
                                  "exclusive": True}}
    assert SlurmBackend().request_flags(job) == [
        "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--account=me", "--time=5",
        "--exclusive"]
    with pytest.raises(BackendError, match=r"--backend-args: '-A': Slurm flags are given as "):
        flag_parameters(["-A", "me"])


def test_local_jobs_run_in_order_and_afterok_skips_what_follows_a_failure(tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.delenv("SCSE_LOCAL_JOB_ID", raising=False)
    backend = LocalBackend()
    log = tmp_path / "order.txt"

    def command(text: str, code: int = 0) -> list[str]:
        return ["bash", "-c", f"echo {text}:$SCSE_LOCAL_JOB_ID >> {log}; exit {code}"]

    def job(text: str, code: int = 0, **kw) -> Job:
        return Job(command=command(text, code), name=text, log_dir=tmp_path / "logs", **kw)

    ok = backend.submit(job("first"))
    failed = backend.submit(job("second", code=3, after=[ok]))
    never = backend.submit(job("third", after=[ok, failed]))
    anyway = backend.submit(job("fourth", after=[failed], dependency="afterany"))
    array = backend.submit_array(job("task", after=[anyway]),
                                 [Task(command(f"task{i}"), f"t{i}") for i in range(3)],
                                 max_parallel=2)
    assert log.read_text().split() == [f"first:{ok}", f"second:{failed}", f"fourth:{anyway}",
                                       f"task0:{array}_0", f"task1:{array}_1", f"task2:{array}_2"]
    assert backend.exit_status == {ok: 0, failed: 3, never: None, anyway: 0, array: 0}
    assert (backend.ended_with(failed), backend.ended_with(never)) == (3, None)
    assert (tmp_path / "logs" / f"task-{array}_2.out").is_file()
    assert f"local job {failed} (second) exited 3" in capsys.readouterr().out
    assert backend.current_job() is None
    with pytest.raises(BackendError, match="no local job 1.2"):
        backend.cancel("1.2")


def test_local_check_names_what_this_machine_cannot_give(monkeypatch):
    backend = LocalBackend()
    with pytest.raises(BackendError, match="nodes and tasks_per_node must be 1, got 2 and 1"):
        backend.check(Job(command=["x"], resources=Resources(nodes=2)))
    monkeypatch.setattr("scse_dist.launch.backends.local.visible_gpus", lambda: 0)
    with pytest.raises(BackendError, match=r"has 0 GPU\(s\) and \d+ CPU\(s\); asked for 1 and 1"):
        backend.check(Job(command=["x"], resources=Resources(gpus_per_node=1)))
    with pytest.raises(BackendError, match="takes no --backend-args, got --hold"):
        backend.check(Job(command=["x"], backend_args=["--hold"]))
    backend.check(Job(command=[sys.executable], resources=Resources()))


@pytest.mark.slow
def test_local_backend_runs_a_study_through_the_same_job_flow(tmp_path, tiny_config, user_env):
    """scse-study --backend local: the final array (a run that trains and one that fails), each
    evaluated in its job, then the report stage job naming the failure and exiting 1, as the
    command then does; about a minute."""
    base = tiny_config(tmp_path, "train.max_steps=4", "train.checkpoint.every=4")
    spec = {"name": "loc", "out": str(tmp_path / "studies"), "base": base, "seeds": [0],
            "variants": {"scse": {"overrides": {}},
                         "broken": {"overrides": {"data.path": str(tmp_path / "missing")}}},
            "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "scse_dist.study.cli", str(tmp_path / "spec.yaml"),
                          "--backend", "local"], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(user_env, WANDB_MODE="disabled"), timeout=600)
    # the failed run fails the report job, and so the command, which names the run
    assert out.returncode == 1, out.stdout + out.stderr
    d = tmp_path / "studies" / "loc"
    assert out.stdout.rstrip().splitlines()[-1] == \
        f"scse-study: FAILED {d / 'broken' / 'broken-seed0'}: training did not finish", out.stdout
    final = json.loads((d / "logs" / "final.json").read_text())
    assert f"local job {final['array']}_0 (loc-final) exited 0" in out.stdout, out.stdout
    assert f"local job {final['array']}_1 (loc-final) exited 66" in out.stdout, out.stdout
    run = d / "scse" / "scse-seed0"
    heldout = json.loads((run / "eval" / "heldout.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2] and \
        (run / "eval" / "report.md").is_file()
    report_log = (d / "logs" / f"loc-report-{final['next']}.out").read_text()
    assert f"FAILED {d / 'broken' / 'broken-seed0'}: training did not finish" in report_log, \
        report_log
    assert "## heldout ppl" in (d / "report" / "report.md").read_text()


@pytest.mark.slow
def test_local_backend_launch_trains_evaluates_and_reports_in_one_job(tmp_path, tiny_config,
                                                                      user_env):
    cfg = tiny_config(tmp_path, "train.max_steps=4", "eval.tasks=[heldout]")
    out = subprocess.run(["scse-launch", cfg, "--backend", "local"], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(user_env, WANDB_MODE="disabled"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.splitlines()[-1]  # the job id alone, as sbatch --parsable prints it
    assert f"local job {job} (tiny) exited 0" in out.stdout
    run = tmp_path / "runs" / "tiny"
    heldout = json.loads((run / "eval" / "heldout.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2]
    assert (run / "eval" / "report.md").is_file() and not (run / "eval" / "scheduled.json").exists()
    assert "scse-launch: report" in (run / "logs" / f"tiny-{job}.out").read_text()
    # a training job that fails here is scse-launch's failure too: its status and one line
    env = dict(user_env, WANDB_MODE="disabled")
    # a missing input is refused before the job queues: one line naming the field, no job
    missing = subprocess.run(["scse-launch", cfg, f"data.path={tmp_path}/missing", "name=gone",
                              "--backend", "local"], capture_output=True, text=True, cwd=tmp_path,
                             env=env, timeout=600)
    assert missing.returncode == 66 and missing.stderr.startswith("scse-launch: error: data.path: ")
    assert len(missing.stderr.splitlines()) == 1 and not (tmp_path / "runs" / "gone").exists()
    # nothing to resume under resume=require: only the training job can tell (exit 2 there)
    broken = subprocess.run(["scse-launch", cfg, "train.start.resume=require", "name=broken",
                             "--backend", "local"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=600)
    job = broken.stdout.splitlines()[-1]
    assert broken.returncode == 2 and broken.stderr == \
        f"scse-launch: training job {job} exited 2 (its logs say why)\n", broken.stderr
    err_log = tmp_path / "runs" / "broken" / "logs" / f"broken-{job}.err"
    assert "scse-train: config error:" in err_log.read_text()


@pytest.mark.slow
def test_a_non_editable_install_launches_from_any_directory(tmp_path, tiny_config, user_env):
    """The package installed as a wheel (no checkout on the path), scse-launch run from a directory
    of its own: the training job is the installed entry point, so it trains, evaluates and
    reports as from the checkout."""
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--no-build-isolation", "--target", str(site), str(REPO_ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    cfg = tiny_config(tmp_path, "train.max_steps=3", "eval.tasks=[heldout]")
    exp = tmp_path / "exp"
    exp.mkdir()
    env = dict(user_env, PYTHONPATH=str(site), WANDB_MODE="disabled")
    where = subprocess.run([sys.executable, "-c", "import scse_dist; print(scse_dist.__file__)"],
                           capture_output=True, text=True, cwd=exp, env=env, check=True).stdout
    assert where.startswith(str(site)), where
    out = subprocess.run([sys.executable, "-m", "scse_dist.launch.scheduler", cfg,
                          "--backend", "local"],
                         capture_output=True, text=True, cwd=exp, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "runs" / "tiny"
    heldout = json.loads((run / "eval" / "heldout.json").read_text())
    assert [r["depth"] for r in heldout["results"]] == [1, 2]
    assert (run / "eval" / "report.md").is_file()


@pytest.mark.parametrize("array", [False, True])
@pytest.mark.parametrize("logs_existed", [False, True])
def test_a_refused_sbatch_leaves_the_log_dir_as_it_found_it(tmp_path, monkeypatch, array,
                                                            logs_existed):
    """sbatch exits 1: BackendError naming its last line, and submitit's submission script and
    pickles removed (the log dir too when the submission made it); an earlier job's files stay."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 'sbatch: error: Batch job submission failed: queue full' "
                                  ">&2; exit 1"), ("srun", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    logs = tmp_path / "run" / "logs"
    if logs_existed:  # an earlier submission's files
        logs.mkdir(parents=True)
        for name in ("1_submission.sh", "1_0_result.pkl", ".submission_file_old.sh"):
            (logs / name).write_text("earlier")
    before = sorted((p, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))
    job = Job(command=["true"], name="j", log_dir=logs)
    with pytest.raises(BackendError, match=r"^sbatch failed: .*queue full"):
        if array:
            SlurmBackend().submit_array(job, [Task(["true"], "a"), Task(["true"], "b")], 2)
        else:
            SlurmBackend().submit(job)
    assert sorted((p, p.read_bytes() if p.is_file() else None)
                  for p in tmp_path.rglob("*")) == before
