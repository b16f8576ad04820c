"""The profiler callback's window of steps, its trace files, the model's loop-step labels in a
trace, and DeepSpeed's flops-profiler section (CUDA only). A real run: test_train_tensorboard.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from scse_dist.config import load_config
from scse_dist.train.callbacks.assembly import check_callbacks, config_of
from scse_dist.train.callbacks.profiler import ProfilerCallback, window_schedule
from scse_dist.train.engine import build_ds_config
from scse_dist.typed_yaml import ConfigError

NONE, WARMUP = ProfilerAction.NONE, ProfilerAction.WARMUP
RECORD, SAVE = ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE

PR = "train.callbacks.profiler.init_args"


def actions(first: int, start: int, warmup: int, steps: int, upto: int) -> list[ProfilerAction]:
    schedule = window_schedule(first, start, warmup, steps)
    return [schedule(k) for k in range(first, upto + 1)]


def test_the_window_warms_up_before_its_first_step_and_saves_at_its_last():
    assert actions(1, 4, 2, 3, 8) == [NONE, WARMUP, WARMUP, RECORD, RECORD, SAVE, NONE, NONE]
    assert window_schedule(1, 4, 2, 3)(0) is NONE  # what profile() asks when it is built
    # the warmup shrinks to the steps there are: from step 1, or just after a resume
    assert actions(1, 2, 3, 1, 3) == [WARMUP, SAVE, NONE]
    assert actions(1, 1, 1, 2, 3) == [RECORD, SAVE, NONE]
    assert window_schedule(1, 1, 1, 2)(0) is RECORD  # built already inside the window
    assert actions(6, 4, 2, 3, 7) == [SAVE, NONE]  # resumed at step 5, inside the window


def fake_state(tmp_path: Path, rank: int = 0, world_size: int = 1, step: int = 0
               ) -> SimpleNamespace:
    return SimpleNamespace(env=SimpleNamespace(rank=rank, world_size=world_size), rank0=rank == 0,
                           engine=SimpleNamespace(device=torch.device("cpu")),
                           run_dir=tmp_path, step=step, max_steps=20, stop_reason=None)


def profile_cfg(*overrides: str):
    cfg = load_config(None, ["train.callbacks.profiler.enabled=true", *overrides])
    return config_of(cfg.train.callbacks, "profiler")


def test_a_window_cut_short_by_the_end_of_the_run_keeps_the_steps_it_recorded(tmp_path, capsys):
    callback = ProfilerCallback(profile_cfg("profile.start_step=2", "profile.steps=5",
                                            "profile.warmup_steps=1"))
    state = fake_state(tmp_path)
    callback.on_start(state)
    for step in (1, 2, 3):
        torch.ones(8, 8) @ torch.ones(8, 8)
        state.step = step
        state.stop_reason = "SIGTERM" if step == 3 else None  # preempted at step 3
        callback.on_step_end(state)
    assert callback.profiler is None  # stopped at the run's last step, not at its teardown
    callback.on_teardown(state)
    trace = tmp_path / "profile" / "rank0.steps2-3.pt.trace.json"
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == \
        ["rank0.steps2-3.pt.trace.json", "rank0.steps2-3.txt"]
    spans = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert {n for n in spans if n.startswith("ProfilerStep#")} == \
        {"ProfilerStep#2", "ProfilerStep#3"}
    assert "aten::mm" in spans
    assert "aten::mm" in (tmp_path / "profile" / "rank0.steps2-3.txt").read_text()
    out = capsys.readouterr().out
    assert f"profile: steps 2..3 of rank 0 in {trace}" in out
    assert "profile: DeepSpeed's flops profiler runs on CUDA only; skipped on CPU" in out


def test_only_the_listed_ranks_profile_and_a_resume_past_the_window_profiles_nothing(tmp_path,
                                                                                     capsys):
    cfg = profile_cfg("profile.ranks=[1]", "profile.start_step=3", "profile.flops_step=0")
    callback = ProfilerCallback(cfg)
    callback.on_start(fake_state(tmp_path, rank=0, world_size=2))
    assert callback.profiler is None and not (tmp_path / "profile").exists()
    callback = ProfilerCallback(cfg)
    callback.on_start(fake_state(tmp_path, rank=1, world_size=2, step=10))
    assert callback.profiler is None
    assert capsys.readouterr().out == \
        "profile: steps 3..4 were done before this run resumed at step 10: nothing profiled\n"
    with pytest.raises(ConfigError, match=rf"^{PR}.ranks: none of \[1\] is a rank of this run "
                                          r"\(world size 1\)$"):
        ProfilerCallback(cfg).on_start(fake_state(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    ("start_step=0", "start_step: must be >= 1, got 0"),
    ("steps=0", "steps: must be >= 1, got 0"),
    ("ranks=[]", "ranks: need a non-empty list of ranks >= 0, got []"),
    ("flops_step=-1", "flops_step: must be >= 0 (0: off), got -1"),
    ("start_step=300",
     "start_step: 300 is past train.max_steps=200, so nothing would be profiled; lower it"),
])
def test_bad_profile_fields_are_one_line(overrides, message):
    cfg = load_config(None, ["train.callbacks.profiler.enabled=true", f"{PR}.{overrides}"])
    with pytest.raises(ConfigError) as err:
        check_callbacks(cfg)  # its fields, then against the run
    assert str(err.value) == f"{PR}.{message}"


def loop_labels(checkpointing: str, depth: int, backward: bool) -> list[str]:
    from scse_dist.model import LoopedLM
    from scse_dist.model.config import ModelConfig

    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=16,
                                 recurrence="scse", depth=2,
                                 activation_checkpointing=checkpointing))
    tokens = torch.randint(0, 64, (2, 16))
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model(tokens, tokens, depth=depth)
        if backward:
            out.loss.backward()
    return sorted(e.name for e in prof.events() if e.name.startswith("loop_step_"))


def test_the_model_labels_each_loop_step_and_each_recomputation_of_a_checkpointed_one():
    steps = [f"loop_step_{t}" for t in range(3)]
    assert loop_labels("none", 3, backward=True) == steps
    assert loop_labels("loop", 3, backward=False) == steps  # nothing recomputed without backward
    assert loop_labels("loop", 3, backward=True) == \
        sorted(steps + [f"{s}_recompute" for s in steps])
    assert loop_labels("block", 3, backward=True) == steps  # blocks recompute inside the step


def test_the_flops_profiler_section_is_generated_on_cuda_only():
    cfg = load_config(None, ["profile.enabled=true", "profile.start_step=5", "profile.steps=2"])
    assert cfg.train.callbacks["profiler"].init_args == {"start_step": 5, "steps": 2}  # old keys
    assert build_ds_config(cfg.train, cfg.run_dir, on_cuda=True)["flops_profiler"] == {
        "enabled": True, "profile_step": 6,  # DeepSpeed counts the steps done: this is step 7
        "module_depth": -1, "top_modules": 3, "detailed": True,
        "output_file": "runs/run/profile/flops_step7.txt"}
    assert "flops_profiler" not in build_ds_config(cfg.train, cfg.run_dir, on_cuda=False)
    at_3 = load_config(None, ["profile.enabled=true", "profile.flops_step=3"])
    section = build_ds_config(at_3.train, at_3.run_dir, on_cuda=True)["flops_profiler"]
    assert section["profile_step"] == 2
    for overrides in ([], ["profile.enabled=true", "profile.flops_step=0"]):
        off = load_config(None, overrides)
        assert "flops_profiler" not in build_ds_config(off.train, off.run_dir, on_cuda=True)
    remote = load_config(None, ["profile.enabled=true", "output_dir=s3://bucket/runs"])
    section = build_ds_config(remote.train, remote.run_dir, on_cuda=True)["flops_profiler"]
    assert section["output_file"] is None
