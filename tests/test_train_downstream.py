"""Downstream tasks during training (eval.downstream_every): the config's checks, rows of kind
downstream in a tiny run at world size 1 and 2 (real gloo processes) equal to scse-eval on the
same step's checkpoint, the cost line, and scse-report's curves. Task files are made here."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import tiny_config_dict
from scse_dist.config import config_from_dict
from scse_dist.eval.curves import downstream_by_depth, eval_rows
from scse_dist.train.callbacks.assembly import check_callbacks
from scse_dist.train.callbacks.downstream import reduce_totals, row_keys
from scse_dist.typed_yaml import ConfigError
from train_procs import REPO, TRAIN, all_passed, read_metrics, train_ranks

TIMING = ("tokens_per_s", "mfu", "step_time_s")
HELLASWAG = [("The cat", ["sees the red ball today.", "builds a quiet house at night."]),
             ("My sister", ["paints the blue river.", "reads an open door again and again.",
                            "likes the bright moon."]),
             ("A small bird", ["follows the tall tree in the park.", "finds a green box."]),
             ("The robot", ["builds a quiet house.", "sees the old man with great care."]),
             ("Our teacher", ["reads the red ball.", "likes a green box today."]),
             ("A dog", ["finds an open door.", "paints the tall tree at night."]),
             ("The old man", ["likes the blue river.", "follows a small bird."])]
LAMBADA = ["the cat sees the red ball today . the dog likes the red ball",
           "a small bird reads an open door at night . our teacher finds the tall tree",
           "my sister paints the blue river . the robot builds a quiet house"]

D = "train.callbacks.downstream"


def _task_files(root) -> dict[str, str]:
    hs, lam = root / "hellaswag_val.jsonl", root / "lambada_test.jsonl"
    hs.write_text("".join(json.dumps({"activity_label": "Story", "ctx_a": c, "ctx_b": "",
                                      "endings": e, "label": i % len(e)}) + "\n"
                          for i, (c, e) in enumerate(HELLASWAG)))
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    return {"hellaswag": str(hs), "lambada": str(lam)}


def _config(tiny_data, tmp_path, lambada: bool = False, **init_args):
    values = tiny_config_dict(tiny_data, str(tmp_path / "runs"))
    values["train"]["callbacks"] = {"downstream": {"init_args": init_args}}
    if lambada:
        values["eval"]["task_settings"] = {"lambada": {"path": "l.jsonl"}}
    return check_callbacks(config_from_dict(values))


ABLE = "wikitext, lambada, hellaswag, piqa, arc_easy, arc_challenge, multiple_choice"


@pytest.mark.parametrize("fields, message", [
    ({"every_steps": 5}, f"{D}.init_args.tasks: every_steps is set, so name the tasks to run "
     f"(any of {ABLE})"),
    ({"tasks": ["heldout"]}, f"{D}.init_args.tasks[0]: 'heldout' does not run during training "
     f"(held-out loss: heldout_eval); the tasks that do: {ABLE}"),
    ({"tasks": ["hellaswg"]}, f"{D}.init_args.tasks[0]: must be one of heldout, validation, "
     "wikitext, lambada, diagnose, hellaswag, piqa, arc_easy, arc_challenge, multiple_choice; got "
     f"'hellaswg' (did you mean 'hellaswag'?); the tasks that do: {ABLE}"),
    ({"tasks": ["piqa"]}, f"{D}.init_args.tasks lists 'piqa', so set "
     "eval.task_settings.piqa.path to its data file"),
    ({"tasks": ["lambada", "lambada"], "lambada": True},
     f"{D}.init_args.tasks[1]: 'lambada' is listed twice"),
    ({"max_examples": -1}, f"{D}.init_args.max_examples: must be >= 0, got -1"),
    ({"every_steps": -1}, f"{D}.init_args.every_steps: must be >= 0, got -1"),
])
def test_bad_downstream_fields_are_one_line_naming_the_field(tiny_data, tmp_path, fields, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        _config(tiny_data, tmp_path, **fields)


def test_downstream_needs_zero_stage_below_3(tiny_data, tmp_path):
    values = tiny_config_dict(tiny_data, str(tmp_path / "runs"))
    values["train"]["engine"] = {"zero_stage": 3}
    values["eval"].update(downstream_every=5, downstream_tasks=["lambada"],
                          task_settings={"lambada": {"path": "l.jsonl"}})  # the old names
    with pytest.raises(ConfigError, match=rf"^{D}: downstream tasks during "
                                          r"training run at ZeRO stage 0, 1 or 2"):
        check_callbacks(config_from_dict(values))


def test_reduce_totals_of_one_rank_and_row_keys():
    totals = [{"depth": 1, "correct": 2, "examples": 5}, {"depth": 4, "correct": 3, "examples": 5}]
    import torch

    assert reduce_totals(totals, torch.device("cpu")) == [
        {"depth": 1, "correct": 2.0, "examples": 5.0},
        {"depth": 4, "correct": 3.0, "examples": 5.0}]
    assert row_keys("arc_easy", {"depth": 2, "accuracy": 0.5, "acc_norm": 0.25, "examples": 4}) == {
        "arc_easy_acc_norm_T2": 0.25, "arc_easy_accuracy_T2": 0.5}


def _scse_eval(task: str, checkpoint, data: str, out, env) -> dict[int, dict]:
    """scse-eval --task on a checkpoint, in a process of its own: {depth: row}."""
    proc = subprocess.run([sys.executable, "-m", "scse_dist.eval.cli", "--checkpoint",
                           str(checkpoint), "--task", task, "--data", data, "--depths", "1,2",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["depth"]: r for r in json.loads(out.read_text())["results"]}


def _check_rows_equal_scse_eval(rows, run_dir, files, env, tmp_path):
    """The step-10 row's numbers are scse-eval's on checkpoint step-10 (one process, every
    example): accuracies exactly, losses to rounding; 5 of 7 questions (max_examples)."""
    last = rows[-1]
    assert last["step"] == 10 and last["hellaswag_examples"] == 5 and last["lambada_examples"] == 3
    tag = run_dir / "checkpoints" / "step-0000010"
    first5 = tmp_path / "hs5.jsonl"
    first5.write_text("".join(open(files["hellaswag"]).readlines()[:5]))
    hs = _scse_eval("hellaswag", tag, str(first5), tmp_path / "hs.json", env)
    lam = _scse_eval("lambada", tag, files["lambada"], tmp_path / "lam.json", env)
    for d in (1, 2):
        assert last[f"hellaswag_accuracy_T{d}"] == hs[d]["accuracy"]
        assert last[f"hellaswag_acc_norm_T{d}"] == hs[d]["acc_norm"]
        assert last[f"lambada_accuracy_T{d}"] == lam[d]["accuracy"]
        assert last[f"lambada_ppl_T{d}"] == pytest.approx(lam[d]["ppl"], rel=1e-6)


def _overrides(files) -> list[str]:
    return ["train.max_steps=10", "eval.downstream_every=5",
            "eval.downstream_tasks=[hellaswag,lambada]", "eval.downstream_max_examples=5",
            f"eval.task_settings.hellaswag.path={files['hellaswag']}",
            f"eval.task_settings.lambada.path={files['lambada']}"]


@pytest.mark.slow
def test_downstream_rows_at_world_size_1_leave_training_alone_and_are_drawn(
        tmp_path, tiny_config, subprocess_env):
    from scse_dist.study.report_cli import main as report_main

    files = _task_files(tmp_path)
    (tmp_path / "plain").mkdir()
    plain = tiny_config(tmp_path / "plain", "train.max_steps=10")
    config = tiny_config(tmp_path, "eval.after_train=true", *_overrides(files))
    outs = [subprocess.run([sys.executable, TRAIN, "--config", c], cwd=REPO, env=subprocess_env,
                           capture_output=True, text=True, timeout=300) for c in (plain, config)]
    for out in outs:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stdout = outs[1].stdout
    run_dir = tmp_path / "runs" / "tiny"
    rows = read_metrics(run_dir)
    drop = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    # evaluating in between changes no training row
    assert [drop(r) for r in rows if "kind" not in r] == \
        [drop(r) for r in read_metrics(tmp_path / "plain" / "runs" / "tiny")]
    downstream = [r for r in rows if r.get("kind") == "downstream"]
    assert [r["step"] for r in downstream] == [5, 10]
    assert set(downstream[0]) == {
        "step", "kind", "downstream_time_s", "hellaswag_examples", "lambada_examples",
        "hellaswag_time_s", "lambada_time_s",
        *(f"hellaswag_{m}_T{d}" for m in ("accuracy", "acc_norm", "acc_bytes") for d in (1, 2)),
        *(f"lambada_{m}_T{d}" for m in ("accuracy", "ppl", "loss") for d in (1, 2))}
    # the cost, once: seconds and training steps
    assert len(re.findall(r"^downstream eval: \d+\.\d\d s, = \d+\.\d training steps \(\d\.\d{3} s "
                          r"each\)$", stdout, re.M)) == 1, stdout
    assert re.search(r"^downstream step     10 \| hellaswag acc_norm T1 \d\.\d{4} T2 \d\.\d{4} \| "
                     r"lambada accuracy T1 ", stdout, re.M), stdout
    _check_rows_equal_scse_eval(downstream, run_dir, files, subprocess_env, tmp_path)
    # scse-report draws them: each task's headline against step, a line per depth
    assert downstream_by_depth(eval_rows(run_dir, "downstream"))["hellaswag"][2] == [
        (5, downstream[0]["hellaswag_acc_norm_T2"]), (10, downstream[1]["hellaswag_acc_norm_T2"])]
    assert report_main([str(run_dir), "--out", str(tmp_path / "report")]) == 0
    import matplotlib.image

    image = matplotlib.image.imread(str(tmp_path / "report" / "downstream_curve.png"))
    assert image.shape[1] > 400 and image[..., :3].std() > 0.01  # two panels, lines drawn
    assert "![downstream tasks during training](downstream_curve.png)" in \
        (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow
def test_downstream_rows_at_world_size_2_are_every_rank_share_summed(
        tmp_path, tiny_config, subprocess_env):
    files = _task_files(tmp_path)
    # 5 questions over 2 ranks: 3 and 2
    stdout = all_passed(train_ranks(tiny_config(tmp_path, *_overrides(files)), subprocess_env))
    run_dir = tmp_path / "runs" / "tiny"
    downstream = [r for r in read_metrics(run_dir) if r.get("kind") == "downstream"]
    assert [r["step"] for r in downstream] == [5, 10]
    assert stdout.count("downstream eval: ") == 1  # rank 0 only, once
    _check_rows_equal_scse_eval(downstream, run_dir, files, subprocess_env, tmp_path)
