"""scse-launch: --local runs training, every eval task and the report; Slurm scheduling submits
each eval job afterok the training job, the report after them, and only once per training job."""

import json
import subprocess
import sys

import pytest

from scse_dist.config import load_config
from scse_dist.launch import scheduler


class FakeJob:
    def __init__(self, job_id):
        self.job_id = job_id


class FakeExecutor:
    """Records what schedule_evals submits instead of calling sbatch."""

    submitted: list = []

    def __init__(self, folder, cluster):
        assert cluster == "slurm"
        self.params = {}

    def update_parameters(self, **params):
        self.params.update(params)

    def submit(self, fn, *args):
        job = FakeJob(str(100 + len(FakeExecutor.submitted)))
        FakeExecutor.submitted.append((fn.__name__, args, dict(self.params)))
        return job


def test_eval_jobs_depend_on_training_and_are_scheduled_once_per_job(tmp_path, tiny_config,
                                                                     monkeypatch):
    import submitit

    monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
    FakeExecutor.submitted = []
    cfg = load_config(tiny_config(tmp_path, "eval.tasks=[heldout,diagnose]", "eval.slurm_gpus=1"))
    assert scheduler.schedule_evals(cfg, "42") == ["100", "101", "102"]
    (fn1, args1, p1), (fn2, args2, _), (fn3, args3, p3) = FakeExecutor.submitted
    run_dir = str((tmp_path / "runs" / "tiny").resolve())
    assert (fn1, args1, fn2, args2) == ("evaluate_run", (run_dir, "heldout"),
                                        "evaluate_run", (run_dir, "diagnose"))
    assert p1["slurm_additional_parameters"] == {"dependency": "afterok:42"}
    assert p1["gpus_per_node"] == 1 and p1["name"] == "tiny-eval"
    assert (fn3, args3) == ("report_run", (run_dir,))
    assert p3["slurm_additional_parameters"] == {"dependency": "afterok:100:101"}
    marker = json.loads((tmp_path / "runs" / "tiny" / "eval" / "scheduled.json").read_text())
    assert marker == {"train_job": "42", "eval_jobs": {"heldout": "100", "diagnose": "101"},
                      "report_job": "102"}
    # the requeued training job (same id) calls again: nothing new
    assert scheduler.schedule_evals(cfg, "42") == [] and len(FakeExecutor.submitted) == 3
    # a new training job of the same run is a new training: its evaluations are scheduled
    assert len(scheduler.schedule_evals(cfg, "43")) == 3


def test_tasks_that_need_a_file_say_which_field(tmp_path, tiny_config, capsys):
    assert scheduler.main([tiny_config(tmp_path), "eval.tasks=[heldout,lambada]", "--local"]) == 2
    assert "eval.lambada: eval.tasks lists 'lambada', so set eval.lambada" in capsys.readouterr().err


def test_local_launch_trains_evaluates_every_task_and_reports(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path, "train.max_steps=4", "eval.tasks=[heldout,diagnose]")
    out = subprocess.run([sys.executable, "-m", "scse_dist.launch.scheduler", cfg, "--local"],
                         capture_output=True, text=True, env=subprocess_env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    eval_dir = tmp_path / "runs" / "tiny" / "eval"
    heldout = json.loads((eval_dir / "heldout.json").read_text())
    diagnose = json.loads((eval_dir / "diagnose.json").read_text())
    assert heldout["checkpoint"] == "tiny@export" and [r["depth"] for r in heldout["results"]] == [1, 2]
    assert [r["depth"] for r in diagnose["results"]] == [1, 2]
    report = (eval_dir / "report.md").read_text()
    ppl = heldout["results"][1]["ppl"]
    assert f"| tiny (scse) | heldout | ppl | {heldout['results'][0]['ppl']:.4f} | {ppl:.4f} |" in report
    assert (eval_dir / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    # the same numbers as evaluating the export again
    assert scheduler.evaluate_run(str(tmp_path / "runs" / "tiny"), "heldout")
    again = json.loads((eval_dir / "heldout.json").read_text())
    assert [r["ppl"] for r in again["results"]] == pytest.approx([r["ppl"] for r in heldout["results"]])


def test_training_script_is_found_or_named(tmp_path, tiny_config, monkeypatch, capsys):
    """The package's checkout first, else ./slurm/pretrain.sh, else an error naming both."""
    assert scheduler.pretrain_script(None) == scheduler.PRETRAIN_SCRIPT  # this checkout
    monkeypatch.setattr(scheduler, "PRETRAIN_SCRIPT", tmp_path / "site-packages" / "pretrain.sh")
    monkeypatch.chdir(tmp_path)
    assert scheduler.main([tiny_config(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "site-packages/pretrain.sh or " in err and str(tmp_path / "slurm" / "pretrain.sh") in err
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "pretrain.sh").write_text("#!/bin/bash\n")
    assert scheduler.pretrain_script(None) == tmp_path / "slurm" / "pretrain.sh"
    with pytest.raises(FileNotFoundError, match="nope.sh"):
        scheduler.pretrain_script(str(tmp_path / "nope.sh"))
