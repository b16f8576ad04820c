"""Faults in real 2-rank runs: preemption, a kill during a checkpoint write, NaN steps, resume.

Every scenario is compared with one uninterrupted 2-rank run (ZeRO-1, fp32 on CPU): a run that
was preempted or killed and then resumed must end with exactly the same parameters.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scse_dist.atomic import NO_SPACE_FAULT_ENV
from scse_dist.train.faults import (
    NONFINITE_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    FaultInjector,
    parse_faults,
)
from train_procs import REPO, TRAIN, all_passed, read_metrics, train_ranks

pytestmark = pytest.mark.slow

NO_SPACE = 74  # scse_dist.cli_errors.EXIT_NO_SPACE

STEPS = ("train.max_steps=12", "train.checkpoint.every=4", "train.log_every=1")


def exported(run_dir):
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config, subprocess_env):
    root = tmp_path_factory.mktemp("reference")
    config = tiny_config(root, *STEPS)
    all_passed(train_ranks(config, subprocess_env))
    return {"params": exported(root / "runs" / "tiny"), "config": config}


@pytest.fixture
def env(subprocess_env):
    # A dead peer must end the survivors within bounded time (the collective timeout).
    return dict(subprocess_env, SCSE_DIST_TIMEOUT_S="30")


def tag_dirs(ckpts):
    return sorted(p.name for p in ckpts.iterdir() if p.is_dir())


def assert_same_params(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_sigterm_on_one_rank_saves_exits_for_requeue_and_resumes_exactly(tmp_path, tiny_config,
                                                                        env, reference):
    cfg = tiny_config(tmp_path, *STEPS)
    run_dir = tmp_path / "runs" / "tiny"
    results = train_ranks(cfg, env, extra_env={"SCSE_FAULT": "sigterm@6:rank1"})
    # Only rank 1 got the signal; both agree at the end of step 6, save it and exit 75.
    assert [r.returncode for r in results] == [REQUEUE_EXIT_CODE] * 2, results[1].tail()
    assert "preempted by a signal on another rank: saved step-0000006" in results[0].stdout
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000006"
    assert tag_dirs(ckpts) == ["step-0000004", "step-0000006"]
    assert read_metrics(run_dir)[-1]["step"] == 6
    assert not (run_dir / "export").exists()

    stdout = all_passed(train_ranks(cfg, env))  # the requeued job: same command, no fault
    assert "at step 6 (data stream and RNG restored)" in stdout
    assert_same_params(exported(run_dir), reference["params"])


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, tiny_config,
                                                                        env, reference):
    cfg = tiny_config(tmp_path, *STEPS)
    run_dir = tmp_path / "runs" / "tiny"
    # Rank 1 dies by SIGKILL after writing its part of step 8, before the save is committed.
    results = train_ranks(cfg, env, extra_env={"SCSE_FAULT": "kill_in_save@8:rank1"})
    assert results[1].returncode == -9
    assert results[0].returncode not in (0, REQUEUE_EXIT_CODE)  # the dead peer ends rank 0 too
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000004"
    assert (ckpts / ".tmp-step-0000008").is_dir() and not (ckpts / "step-0000008").exists()

    stdout = all_passed(train_ranks(cfg, env))
    assert "removed" in stdout and ".tmp-step-0000008: a save that did not finish" in stdout
    assert "at step 4 (data stream and RNG restored)" in stdout
    assert_same_params(exported(run_dir), reference["params"])
    assert not list(ckpts.glob(".tmp-*"))


def test_no_space_on_one_rank_stops_every_rank_with_74_and_the_rerun_resumes_exactly(
        tmp_path, tiny_config, env, reference):
    cfg = tiny_config(tmp_path, *STEPS)
    run_dir = tmp_path / "runs" / "tiny"
    ckpts = run_dir / "checkpoints"
    # Rank 1's optimizer states of step 8 do not fit (inside DeepSpeed's save); rank 0's do.
    fault = {NO_SPACE_FAULT_ENV: "*/.tmp-step-0000008/*zero_pp_rank_1_*"}
    results = train_ranks(cfg, env, extra_env=fault)  # a rank left waiting: the 30 s timeout
    assert [r.returncode for r in results] == [NO_SPACE] * 2, results[0].tail() + results[1].tail()
    says = f"scse-train: no space left writing {ckpts / '.tmp-step-0000008'}/zero_pp_rank_1_"
    assert results[1].stderr.splitlines()[-1].startswith(says)
    assert results[0].stderr.splitlines()[-1].startswith(says) and \
        results[0].stderr.rstrip().endswith("(on another rank) (it resumes from step-0000004)")
    assert "Traceback" not in results[0].stderr + results[1].stderr
    assert (ckpts / "latest").read_text() == "step-0000004"
    assert tag_dirs(ckpts) == ["step-0000004"]  # the partial tag removed

    stdout = all_passed(train_ranks(cfg, env))
    assert "at step 4 (data stream and RNG restored)" in stdout
    assert_same_params(exported(run_dir), reference["params"])


def test_nan_on_one_rank_skips_the_step_everywhere_and_k_in_a_row_stop(tmp_path, tiny_config, env):
    cfg = tiny_config(tmp_path, *STEPS, "train.max_nonfinite_steps=3")
    run_dir = tmp_path / "runs" / "tiny"
    # Step 2: NaN on rank 1 only -> skipped on both ranks, training goes on with finite losses.
    # Steps 6-8: NaN three times in a row -> stop with status 3 before saving step 8.
    faults = "nan@2:rank1,nan@6,nan@7:rank0,nan@8:rank1"
    results = train_ranks(cfg, env, extra_env={"SCSE_FAULT": faults})
    assert [r.returncode for r in results] == [NONFINITE_EXIT_CODE] * 2, results[0].tail()
    assert "step 8: 3 non-finite steps in a row" in results[0].stderr
    assert "last good checkpoint: step-0000004" in results[0].stderr
    assert "step 2: non-finite loss or gradient, step skipped (1 in a row, 1 in all)" in \
        results[0].stdout
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert [rows[s]["skipped_steps"] for s in (1, 2, 3, 5, 6, 7)] == [0, 1, 1, 1, 2, 3]
    assert all(rows[s]["loss"] < 6.5 for s in (1, 3, 4, 5))  # finite: step 2 did not poison it
    assert rows[2]["loss"] != rows[2]["loss"] and rows[6]["loss"] != rows[6]["loss"]  # NaN rows
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000004"
    assert tag_dirs(ckpts) == ["step-0000004"]


def test_fault_spec_parsing_and_rank_filter():
    assert [(f.kind, f.step, f.rank) for f in parse_faults("nan@3, sigterm@5:rank1")] == \
        [("nan", 3, None), ("sigterm", 5, 1)]
    with pytest.raises(ValueError, match="SCSE_FAULT: cannot parse 'boom@3'"):
        parse_faults("boom@3")
    injector = FaultInjector(rank=0, spec="nan@3:rank1,nan@4")
    one = torch.ones(())
    assert injector.loss(3, one) == 1 and torch.isnan(injector.loss(4, one))


def test_resume_at_another_world_size_converts_the_checkpoint_once(reference, subprocess_env):
    # The reference run's checkpoints were written by 2 ranks (ZeRO-1); one rank resumes them
    # through a universal checkpoint kept beside the tag (tests/test_train_reshard.py: exactness).
    out = subprocess.run([sys.executable, TRAIN, "--config", reference["config"],
                          "train.max_steps=13"], env=subprocess_env, cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step-0000012: saved by 2 ranks, resumed by 1" in out.stdout
    ckpts = Path(reference["config"]).parent / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "step-0000012" / "universal").is_dir()
    assert (ckpts / "latest").read_text() == "step-0000013"


def test_nan_at_zero_stage_0_drops_the_gradients_and_goes_on(tmp_path, tiny_config, subprocess_env):
    # Stage 0 has no ZeRO overflow check: the trainer's own check must skip the update.
    cfg = tiny_config(tmp_path, "train.engine.zero_stage=0", "train.max_steps=4",
                      "train.log_every=1")
    out = subprocess.run([sys.executable, TRAIN, "--config", cfg], cwd=REPO, capture_output=True,
                         text=True, timeout=240, env=dict(subprocess_env, SCSE_FAULT="nan@2"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1]
    assert all(rows[s]["loss"] < 6.5 for s in (0, 2, 3))  # finite after the NaN step
    params = exported(tmp_path / "runs" / "tiny")
    assert all(torch.isfinite(v).all() for v in params.values())
