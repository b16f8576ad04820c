"""scse-launch: --local runs training, every eval task and the report; scheduling submits, through
the backend protocol only, each eval job afterok the training job, the report after them, and only
once per training job; a refused submission cancels what was submitted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recording_backend import RecordingBackend
from scse_dist.config import load_config
from scse_dist.eval.export_eval import evaluate_export
from scse_dist.launch import scheduler
from scse_dist.resources import EvalResources, Resources
from scse_dist.typed_yaml import ConfigError


def test_eval_jobs_depend_on_training_and_are_scheduled_once_per_job(tmp_path, tiny_config):
    backend = RecordingBackend()
    cfg = load_config(tiny_config(tmp_path, "eval.tasks=[heldout,diagnose]",
                                  "eval.resources.gpus_per_node=1",
                                  "eval.resources.partition=eval"))
    def schedule(train_job):
        return scheduler.schedule_evals(cfg.eval, cfg.name, cfg.run_dir, train_job, backend)

    assert schedule("42") == ["100", "101", "102"]
    assert backend.kinds() == ["submit"] * 3  # through the protocol only
    (_, j1, _), (_, j2, _), (_, j3, _) = backend.calls
    run_dir = str((tmp_path / "runs" / "tiny").resolve())
    job_cmd = [sys.executable, "-m", "scse_dist.launch.run_job"]
    assert (j1.command, j2.command) == ([*job_cmd, "evaluate", run_dir, "heldout"],
                                        [*job_cmd, "evaluate", run_dir, "diagnose"])
    assert (j1.after, j1.dependency, j1.name) == (["42"], "afterok", "tiny-eval")
    assert j1.resources == EvalResources(nodes=1, tasks_per_node=1, gpus_per_node=1,
                                         cpus_per_task=1, time_min=120, partition="eval")
    assert str(j1.log_dir) == f"{run_dir}/logs"
    assert (j3.command, j3.name) == ([*job_cmd, "report", run_dir], "tiny-report")
    assert (j3.after, j3.dependency) == (["100", "101"], "afterok")
    marker = json.loads((tmp_path / "runs" / "tiny" / "eval" / "scheduled.json").read_text())
    assert marker == {"train_job": "42", "eval_jobs": {"heldout": "100", "diagnose": "101"},
                      "report_job": "102"}
    # the requeued training job (same id) calls again: nothing new
    assert schedule("42") == [] and len(backend.calls) == 3
    # a new training job of the same run is a new training: its evaluations are scheduled
    assert len(schedule("43")) == 3


def test_a_refused_report_job_cancels_the_eval_jobs_and_is_one_line(tmp_path, tiny_config, capsys,
                                                                   monkeypatch):
    backend = RecordingBackend(fail_submit_at=2)
    monkeypatch.setattr(scheduler, "get_backend", lambda name: backend)
    config = tiny_config(tmp_path, "eval.tasks=[heldout,diagnose]")
    assert scheduler.main([config, "--after-job", "42"]) == 1
    assert capsys.readouterr().err == "scse-launch: queue is full\n"
    assert [c[0] if c[0] == "submit" else c for c in backend.calls] == \
        ["submit", "submit", ("cancel", "100"), ("cancel", "101")]
    # retried next time
    assert not (tmp_path / "runs" / "tiny" / "eval" / "scheduled.json").exists()


def test_the_training_job_is_run_job_train_with_config_overrides_and_resources(
        tmp_path, tiny_config, capsys, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(scheduler, "get_backend", lambda name: backend)
    monkeypatch.chdir(tmp_path)  # any directory: the config is passed on by its absolute path
    config = tiny_config(tmp_path)
    relative = str(Path(config).relative_to(tmp_path))
    assert scheduler.main([relative, "train.max_steps=3", "resources.nodes=2", "--backend-args",
                           "--hold --account=me"]) == 0
    assert capsys.readouterr().out == "100\n"  # the job id alone
    ((kind, job, _),) = backend.calls
    assert job.command == [sys.executable, "-m", "scse_dist.launch.run_job", "train", config,
                           "train.max_steps=3", "resources.nodes=2", "--schedule-evals=recording"]
    assert job.backend_args == ["--hold", "--account=me"] and job.resources == Resources(nodes=2)
    run_dir = (tmp_path / "runs" / "tiny").resolve()
    assert (job.name, job.log_dir, job.after) == ("tiny", run_dir / "logs", [])
    # the old flag's name still works, with one notice line
    assert scheduler.main([config, "--sbatch-args=--hold"]) == 0
    assert backend.calls[-1][1].backend_args == ["--hold"]
    assert capsys.readouterr().err == ("scse-launch: notice: --sbatch-args is now --backend-args; "
                                       "the old name is read for now\n")


def test_a_global_batch_the_jobs_world_cannot_divide_is_refused_before_it_queues(
        tmp_path, tiny_config, capsys, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(scheduler, "get_backend", lambda name: backend)
    config = tiny_config(tmp_path, "train.batch.global_batch_size=16")  # micro 4: worlds 1, 2, 4
    assert scheduler.main([config, "resources.nodes=3", "resources.tasks_per_node=1"]) == 2
    assert capsys.readouterr().err == (
        "scse-launch: config error: train.batch.global_batch_size: 16 is not a multiple of "
        "train.batch.micro_batch_size (4) x world size (3, from resources.nodes 3 x "
        "resources.tasks_per_node 1)\n")
    assert backend.calls == [] and not (tmp_path / "runs").exists()
    assert scheduler.main([config, "resources.nodes=2", "resources.tasks_per_node=2"]) == 0
    assert [c[0] for c in backend.calls] == ["submit"]


def test_old_eval_resource_names_load_with_one_notice(tmp_path, tiny_config, capsys, monkeypatch):
    from scse_dist import typed_yaml

    monkeypatch.setattr(typed_yaml, "_noticed", set())
    cfg = load_config(tiny_config(tmp_path), ["eval.slurm_gpus=2", "eval.slurm_time_min=30"])
    again = load_config(tiny_config(tmp_path), ["eval.slurm_gpus=2"])
    assert cfg.eval.resources == EvalResources(gpus_per_node=2, time_min=30)
    assert again.eval.resources.gpus_per_node == 2
    assert capsys.readouterr().err.splitlines() == [
        "config: notice: eval.slurm_gpus is now eval.resources.gpus_per_node; the old name is "
        "read for now",
        "config: notice: eval.slurm_time_min is now eval.resources.time_min; the old name is "
        "read for now"]
    with pytest.raises(ConfigError, match=r"eval.resources: an evaluation is one task on one node"):
        load_config(tiny_config(tmp_path), ["eval.resources.nodes=2"])
    with pytest.raises(ConfigError, match=r"^resources: nodes, tasks_per_node and cpus_per_task "):
        load_config(tiny_config(tmp_path), ["resources.cpus_per_task=0"])


def test_tasks_that_need_a_file_say_which_field(tmp_path, tiny_config, capsys):
    assert scheduler.main([tiny_config(tmp_path), "eval.tasks=[heldout,lambada]", "--local"]) == 2
    assert "eval.task_settings.lambada.path: eval.tasks lists 'lambada', so set " \
        "eval.task_settings.lambada.path" in \
        capsys.readouterr().err


def test_local_launch_trains_evaluates_every_task_and_reports(tmp_path, tiny_config,
                                                              subprocess_env):
    cfg = tiny_config(tmp_path, "train.max_steps=4", "eval.tasks=[heldout,diagnose]")
    out = subprocess.run([sys.executable, "-m", "scse_dist.launch.scheduler", cfg, "--local"],
                         capture_output=True, text=True, env=subprocess_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    eval_dir = tmp_path / "runs" / "tiny" / "eval"
    heldout = json.loads((eval_dir / "heldout.json").read_text())
    diagnose = json.loads((eval_dir / "diagnose.json").read_text())
    assert heldout["checkpoint"] == "tiny@export" and \
        [r["depth"] for r in heldout["results"]] == [1, 2]
    assert [r["depth"] for r in diagnose["results"]] == [1, 2]
    report = (eval_dir / "report.md").read_text()
    ppl = heldout["results"][1]["ppl"]
    assert f"| tiny (scse) | heldout | ppl | {heldout['results'][0]['ppl']:.4f} | {ppl:.4f} |" \
        in report
    assert (eval_dir / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    # the same numbers as evaluating the export again
    assert evaluate_export(str(tmp_path / "runs" / "tiny"), "heldout")
    again = json.loads((eval_dir / "heldout.json").read_text())
    assert [r["ppl"] for r in again["results"]] == \
        pytest.approx([r["ppl"] for r in heldout["results"]])
