"""scse_dist.run_dir: the one owner of a run dir's layout. Its metrics readers agree, and a results
file that a Ctrl-C left "partial" is not an evaluation done: every place that skips one already
done (the study's run status and sweep score, its per-task loop, the launcher's evaluate_all and
benchmarks/optimizer_study.py's cache) evaluates it again, and leaves complete ones alone."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, tiny_config_dict, tiny_documents
from scse_dist.checkpoint.export import save_exported_model
from scse_dist.cli_errors import Interrupted
from scse_dist.config import RunConfig, config_from_dict, save_config
from scse_dist.eval.results import write_results
from scse_dist.model import LoopedLM
from scse_dist.run_dir import PARTIAL_KEY, RunDir, is_complete
from scse_dist.train.metrics import cut_metrics

PARTIAL_LOSS = 99.0  # what a fake Ctrl-C'd file says; a real evaluation of the tiny model differs


def make_export(run_dir: Path, cfg: RunConfig) -> RunDir:
    """A run dir as training leaves it: config.yaml and export/ (an untrained tiny model)."""
    run = RunDir(run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run.config)
    torch.manual_seed(0)
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(run.export))
    return run


def write_partial(path: Path, cfg: RunConfig, task: str = "heldout") -> None:
    """A results file as run_task writes it on Ctrl-C (eval.task_run._write_partial)."""
    write_results(path, task, "x", cfg, [{"depth": 1, "loss": PARTIAL_LOSS, "ppl": 1e6}],
                  extra={PARTIAL_KEY: {"done": 1, "total": 2, "unit": "batch"}})


def write_complete(path: Path, cfg: RunConfig, task: str, loss: float) -> None:
    write_results(path, task, "kept", cfg, [{"depth": 1, "loss": loss, "ppl": 2.0}])


@pytest.fixture
def tiny_run(tiny_data, tmp_path) -> tuple[RunDir, RunConfig]:
    cfg = config_from_dict(tiny_config_dict(tiny_data, str(tmp_path / "runs")))
    return make_export(Path(cfg.run_dir), cfg), cfg


def test_is_complete_only_for_a_whole_results_file(tmp_path, tiny_run):
    _, cfg = tiny_run
    path = tmp_path / "r.json"
    assert not is_complete(path)  # absent
    write_complete(path, cfg, "heldout", 1.0)
    assert is_complete(path)
    write_partial(path, cfg)
    assert not is_complete(path)
    path.write_text('{"task": "heldout", "res')  # torn (not written by atomic_write)
    assert not is_complete(path)
    path.write_bytes(b"\xff\xfe")
    assert not is_complete(path)


def test_a_ctrl_c_during_run_task_leaves_a_file_that_is_not_complete(tiny_run, monkeypatch):
    from scse_dist.eval import perplexity
    from scse_dist.eval.export_eval import evaluate_export
    from scse_dist.eval.task_run import TaskInterrupted

    run, _ = tiny_run

    def interrupted(model, batches, depths, **kwargs):
        raise TaskInterrupted([{"depth": d, "loss": PARTIAL_LOSS, "ppl": 1e6, "tokens": 32}
                               for d in depths], 1, kwargs["max_batches"] or None, "batch")

    monkeypatch.setattr(perplexity, "evaluate_heldout", interrupted)  # the heldout task's call
    with pytest.raises(Interrupted, match="partial results in"):
        evaluate_export(run, "heldout")
    data = json.loads(run.results("heldout").read_text())
    assert data[PARTIAL_KEY] == {"done": 1, "total": 2, "unit": "batch"}
    assert not run.evaluated("heldout")
    monkeypatch.undo()
    assert evaluate_export(run, "heldout") == str(run.results("heldout"))
    assert run.evaluated("heldout")


def test_the_metrics_readers_agree(tmp_path):
    from scse_dist.eval.curves import eval_rows
    from scse_dist.study.collect import load_run

    rows = [{"step": 5, "loss": 3.0}, {"step": 10, "kind": "eval", "heldout_loss_T1": 2.5},
            {"step": 10, "loss": 2.0}, {"step": 10, "kind": "sample", "samples": []},
            {"step": 15, "loss": 1.5}]
    run = RunDir(tmp_path / "study" / "v" / "v-seed0")
    run.path.mkdir(parents=True)
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 20, "lo')
    assert run.metric_rows() == rows  # the torn last line skipped
    assert run.training_rows() == [rows[0], rows[2], rows[4]]
    assert run.rows_of("eval") == eval_rows(run.path) == [rows[1]]
    assert run.rows_of("sample") == [rows[3]]
    study_run = load_run(tmp_path / "study", {"variant": "v", "seed": 0, "run_dir": str(run.path)})
    assert study_run.metrics == run.training_rows()
    # the trainer's cut at a resume reads the file the same way: only the torn line goes
    assert cut_metrics(run.metrics, 15) == 1 and run.metric_rows() == rows
    assert cut_metrics(run.metrics, 5) == 4 and run.metric_rows() == rows[:1]


def _study(tmp_path: Path, tiny_config, **fields):
    from scse_dist.study.spec import parse_spec

    spec = {"name": "s", "out": str(tmp_path / "studies"), "base": tiny_config(tmp_path),
            "variants": {"scse": {}}, "seeds": [0],
            "evals": {"tasks": ["heldout", "diagnose"], "depths": [1, 2]}, **fields}
    return parse_spec(spec, "spec.yaml")


def test_the_study_scores_a_partial_validation_again(tmp_path, tiny_config):
    from scse_dist.study.plan import status
    from scse_dist.study.runs import expand, run_config
    from scse_dist.study.validation import sweep_score as evaluate_validation

    validation = tmp_path / "valid.txt"
    validation.write_text("\n\n".join(tiny_documents(6, seed=7)))
    spec = _study(tmp_path, tiny_config,
                  lr={"values": [1e-3], "seed": 0, "validation": str(validation)})
    (run,) = expand(spec, None, ("sweep",))
    d = make_export(Path(run.run_dir), run_config(spec, run))
    assert status(spec, run) == "partial"  # trained, not scored
    write_partial(d.results("validation"), run_config(spec, run))
    assert status(spec, run) == "partial"
    loss = evaluate_validation(spec, run)
    assert loss != PARTIAL_LOSS and 0 < loss < 20
    scored = json.loads(d.results("validation").read_text())
    assert PARTIAL_KEY not in scored and scored["results"][0]["loss"] == loss
    assert [r["depth"] for r in scored["results"]] == [run_config(spec, run).model.depth]
    assert status(spec, run) == "done"
    assert evaluate_validation(spec, run) == loss  # complete now: read, not evaluated again


def test_the_studys_per_task_loop_and_status_redo_a_partial_task(tmp_path, tiny_config):
    from scse_dist.study.execute import _train_and_evaluate
    from scse_dist.study.plan import status
    from scse_dist.study.runs import expand, run_config

    spec = _study(tmp_path, tiny_config)
    (run,) = expand(spec)
    cfg = run_config(spec, run)
    d = make_export(Path(run.run_dir), cfg)
    write_partial(d.results("heldout"), cfg)
    write_complete(d.results("diagnose"), cfg, "diagnose", 1.25)
    kept = d.results("diagnose").read_text()
    assert status(spec, run) == "partial"
    assert _train_and_evaluate(spec, run) == (0, "")  # the export is there: no training
    heldout = json.loads(d.results("heldout").read_text())
    assert PARTIAL_KEY not in heldout and heldout["results"][0]["loss"] != PARTIAL_LOSS
    assert d.results("diagnose").read_text() == kept  # complete: not evaluated again
    assert status(spec, run) == "done"


def test_the_launchers_evaluate_all_redoes_a_partial_task(tiny_run):
    from scse_dist.launch.scheduler import evaluate_all

    run, cfg = tiny_run
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval,
                                                            tasks=["heldout", "diagnose"]))
    write_partial(run.results("heldout"), cfg)
    write_complete(run.results("diagnose"), cfg, "diagnose", 1.25)
    kept = run.results("diagnose").read_text()
    report = Path(evaluate_all(cfg.eval.tasks, cfg.run_dir)).read_text()
    heldout = json.loads(run.results("heldout").read_text())
    assert PARTIAL_KEY not in heldout and heldout["checkpoint"] == "tiny@export"
    assert run.results("diagnose").read_text() == kept
    assert f"| tiny (scse) | heldout | ppl | {heldout['results'][0]['ppl']:.4f} |" in report


def test_the_optimizer_studys_cache_rescores_a_partial_checkpoint(tiny_run, tmp_path, monkeypatch):
    from scse_dist.checkpoint import loading

    spec = importlib.util.spec_from_file_location("optimizer_study",
                                                  REPO_ROOT / "benchmarks" / "optimizer_study.py")
    optimizer_study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(optimizer_study)
    run, cfg = tiny_run
    for step in (2, 4):
        (run.checkpoints / f"step-{step}").mkdir(parents=True)
    load = loading.load_model  # every tag stands for the export's weights here
    monkeypatch.setattr(loading, "load_model", lambda tag, device="cpu": load(run.export, device))
    write_partial(run.results("validation-step-2"), cfg)
    write_complete(run.results("validation-step-4"), cfg, "heldout", 1.5)
    validation = tmp_path / "valid.txt"
    validation.write_text("\n\n".join(tiny_documents(6, seed=7)))
    curve = optimizer_study.validation_curve(run.path, str(validation), 2)
    assert curve[4] == 1.5  # cached
    assert curve[2] != PARTIAL_LOSS and 0 < curve[2] < 20  # scored again
    assert run.evaluated("validation-step-2")
