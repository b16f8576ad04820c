"""LR schedules: exact values at warmup end, stable phase, decay start and end for every shape;
the scheduler's checkpoint state (the step only) and what a resume with another schedule does."""

import dataclasses
import json
import math

import pytest
import torch

from scse_dist.config import load_config
from scse_dist.train.config import TrainConfig
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule import (
    LRSchedule,
    build_lr_scheduler,
    describe,
    follow_config_schedule,
)
from scse_dist.train.schedule_config import ScheduleConfig
from scse_dist.typed_yaml import ConfigError


def schedule(max_steps: int, schedule: str = "cosine", **fields) -> LRSchedule:
    return LRSchedule.from_config(TrainConfig(max_steps=max_steps,
                                              schedule=ScheduleConfig(kind=schedule, **fields)))


def cosine_before_schedules(warmup: int, max_steps: int, min_ratio: float, step: int) -> float:
    """The warmup-cosine multiplier as it was before train.schedule existed (the reference the
    default must reproduce bit for bit: shipped configs keep their curves)."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, max_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_cosine_values():
    f = schedule(warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1)       # first update: lr / warmup
    assert f(4) == pytest.approx(0.5)
    assert f(9) == 1.0                      # end of warmup reaches the peak
    assert f(10) == 1.0                     # cosine starts at the peak
    assert f(59.5) == pytest.approx(0.55)   # half way: (1 + 0.1) / 2
    assert f(109) == pytest.approx(0.1)     # last step: min_lr_ratio exactly
    assert f(500) == pytest.approx(0.1)     # and it stays there


@pytest.mark.parametrize("warmup,max_steps,min_ratio", [
    (10, 110, 0.1), (0, 5, 0.0), (30, 300, 0.1), (2, 20, 0.1), (7, 8, 0.37), (20, 200, 0.013)])
def test_default_schedule_is_the_old_cosine_bit_for_bit(warmup, max_steps, min_ratio):
    f = schedule(warmup_steps=warmup, max_steps=max_steps, min_lr_ratio=min_ratio)
    assert TrainConfig().schedule.kind == "cosine"
    assert [f(s) for s in range(max_steps + 3)] == \
        [cosine_before_schedules(warmup, max_steps, min_ratio, s) for s in range(max_steps + 3)]


def test_no_warmup_starts_at_peak():
    f = schedule(warmup_steps=0, max_steps=5, min_lr_ratio=0.0)
    assert [round(f(s), 6) for s in range(5)] == \
        [1.0, round(0.5 * (1 + math.cos(math.pi / 4)), 6), 0.5,
         round(0.5 * (1 + math.cos(3 * math.pi / 4)), 6), 0.0]


def test_linear_and_constant():
    f = schedule(schedule="linear", warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0  # the decay's anchor, as cosine's
    assert f(5) == pytest.approx(1 - 0.9 / 9)
    assert f(13) == pytest.approx(0.1) and f(40) == pytest.approx(0.1)
    f = schedule(schedule="constant", warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in (0, 3, 4, 13, 10**6)] == [0.25, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("shape,decayed", [
    ("linear", lambda p: 1 - p),
    ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ("1-sqrt", lambda p: 1 - math.sqrt(p))])
def test_wsd_each_shape(shape, decayed):
    # warmup 0..4, stable 5..14 at exactly 1, decay 15..24 (D = 10), min 0.05 at step 24
    f = schedule(schedule="wsd", warmup_steps=5, max_steps=25, decay_steps=10, decay_shape=shape,
                 min_lr_ratio=0.05)
    assert f(0) == pytest.approx(0.2)
    assert f(4) == 1.0                                            # warmup end
    assert all(f(s) == 1.0 for s in range(5, 15))                 # stable, exactly the peak
    for k in range(1, 11):                                        # decay start .. end
        assert f(14 + k) == pytest.approx(0.05 + 0.95 * decayed(k / 10), abs=1e-12)
    assert f(15) < 1.0 and f(24) == pytest.approx(0.05) and f(30) == pytest.approx(0.05)
    # each shape's own curve: 1-sqrt drops fastest at the start, cosine slowest
    assert f(15) == pytest.approx({"linear": 0.905, "cosine": 0.976752, "1-sqrt": 0.699584}[shape],
                                  abs=1e-6)


def test_wsd_decay_fraction_and_bounds():
    t = TrainConfig(max_steps=110, schedule=ScheduleConfig(kind="wsd", warmup_steps=10,
                                                           decay_fraction=0.25))
    assert t.schedule.wsd_decay_steps(t.max_steps) == 28  # round(27.5): half to even
    f = LRSchedule.from_config(t)
    assert f(81) == 1.0 and f(82) < 1.0 and f(109) == pytest.approx(0.1)
    assert ScheduleConfig(kind="wsd", decay_fraction=0.1).wsd_decay_steps(3) == 1
    # the decay may start right after the warmup: D = max_steps - warmup_steps
    f = schedule(schedule="wsd", warmup_steps=2, max_steps=6, decay_steps=4, min_lr_ratio=0.0)
    assert [f(s) for s in range(6)] == [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize("overrides,message", [
    (["train.schedule.kind=wsd", "train.max_steps=20", "train.schedule.warmup_steps=5",
      "train.schedule.decay_steps=16"],
     "train.schedule.decay_steps: the wsd decay of 16 steps overlaps the warmup of 5 in "
     "train.max_steps=20; it may take at most 15"),
    (["train.schedule.kind=wsd", "train.max_steps=20", "train.schedule.warmup_steps=5",
      "train.schedule.decay_fraction=0.9"],
     "train.schedule.decay_fraction: the wsd decay of 18 steps overlaps the warmup of 5 in "
     "train.max_steps=20; it may take at most 15"),
    (["train.schedule.decay_fraction=0"],
     "train.schedule.decay_fraction: must lie in (0, 1], got 0.0"),
    (["train.schedule.decay_steps=0"],
     "train.schedule.decay_steps: must be >= 1 (null: decay_fraction), got 0"),
    (["train.schedule.decay_shape=sqrt"], "train.schedule.decay_shape: must be one of"),
    (["train.schedule.kind=trapezoid"], "train.schedule.kind: must be one of"),
])
def test_bad_schedule_fields_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message)


def drive(scheduler, optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def scheduler_for(train: TrainConfig):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=train.optimizer.lr)
    return build_lr_scheduler(opt, train), opt


def test_scheduler_drives_the_optimizer_lr():
    sched, opt = scheduler_for(TrainConfig(max_steps=20, optimizer=OptimizerConfig(lr=2e-3),
                                           schedule=ScheduleConfig(warmup_steps=4,
                                                                   min_lr_ratio=0.25)))
    lrs = drive(sched, opt, 20)
    assert lrs[0] == pytest.approx(5e-4)
    assert lrs[3] == pytest.approx(2e-3)
    assert lrs[-1] == pytest.approx(5e-4)
    assert max(lrs) == pytest.approx(2e-3)


def test_checkpoint_state_is_the_step_and_the_config_decides_the_rest():
    train = TrainConfig(max_steps=30, optimizer=OptimizerConfig(lr=1e-2),
                        schedule=ScheduleConfig(warmup_steps=3, kind="wsd", decay_steps=10))
    sched, opt = scheduler_for(train)
    whole = drive(sched, opt, 30)
    sched, opt = scheduler_for(train)
    first = drive(sched, opt, 24)  # mid-decay
    state = sched.state_dict()
    assert state == {"last_epoch": 24, "_step_count": 25}
    # a fresh scheduler loads the step; an optimizer checkpoint would have brought the saving
    # run's LR, which apply() replaces
    sched, opt = scheduler_for(train)
    opt.param_groups[0]["lr"] = 123.0
    sched.load_state_dict(state)
    assert first + drive(sched, opt, 6) == whole  # bit for bit
    # another config's scheduler loading the same state follows its own schedule from there
    longer = dataclasses.replace(train, max_steps=60,
                                 schedule=dataclasses.replace(train.schedule, decay_steps=20),
                                 optimizer=OptimizerConfig(lr=2e-2))
    sched, opt = scheduler_for(longer)
    sched.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == 2e-2 * LRSchedule.from_config(longer)(24) == 2e-2


def test_resume_note_names_both_schedules_only_when_the_lr_moves(tmp_path):
    from scse_dist.config import read_saved_config

    def read(path):  # the checkpoint's train section, as plan_resume reads it
        return read_saved_config(path)["train"]

    saved = tmp_path / "config.json"
    stable = TrainConfig(max_steps=100, optimizer=OptimizerConfig(lr=1e-3),
                         schedule=ScheduleConfig(warmup_steps=2, kind="wsd", decay_steps=20))
    saved.write_text(json.dumps({"train": dataclasses.asdict(stable)}))
    # extended in the stable phase: the LR at the resumed step is the same, nothing to say
    longer = dataclasses.replace(stable, max_steps=200)
    sched, _ = scheduler_for(longer)
    sched.load_state_dict({"last_epoch": 50, "_step_count": 51})
    assert follow_config_schedule(sched, longer, read(saved)) is None
    # a cooldown starting now: the LR moves, and the line says from what to what
    cooldown = dataclasses.replace(stable, max_steps=60, schedule=dataclasses.replace(
        stable.schedule, decay_steps=10, decay_shape="1-sqrt"))
    sched, opt = scheduler_for(cooldown)
    sched.load_state_dict({"last_epoch": 50, "_step_count": 51})
    assert follow_config_schedule(sched, cooldown, read(saved)) == (
        "train.schedule: step 51 runs at lr 7.1540e-04 under this config's schedule (wsd 1-sqrt, "
        "decay 10 of 60 steps, warmup 2, lr 0.001); the checkpoint's (wsd linear, decay 20 of "
        "100 steps, warmup 2, lr 0.001) had 1.0000e-03")
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (0.1 + 0.9 * (1 - math.sqrt(0.1))))
    # a checkpoint saved before train.schedule existed ran the cosine: its fields' defaults
    saved.write_text(json.dumps({"train": {"lr": 1e-3, "warmup_steps": 2, "max_steps": 100,
                                           "min_lr_ratio": 0.1}}))
    cosine = TrainConfig(max_steps=100, optimizer=OptimizerConfig(lr=1e-3),
                         schedule=ScheduleConfig(warmup_steps=2))
    sched, _ = scheduler_for(cosine)
    sched.load_state_dict({"last_epoch": 50, "_step_count": 51})
    assert follow_config_schedule(sched, cosine, read(saved)) is None
    assert describe(cosine) == "cosine, 100 steps, warmup 2, lr 0.001"


def test_a_study_varies_the_schedule(tmp_path, tiny_config):
    """Variants and axes are config overrides: a study compares schedules (and decay shapes) as it
    compares recurrences; a bad schedule value names the variant and the field."""
    from scse_dist.study.runs import check_runs, expand, run_config
    from scse_dist.study.spec import SpecError, parse_spec

    spec = {"name": "s", "out": str(tmp_path / "out"), "base": tiny_config(tmp_path),
            "variants": {"cosine": {"overrides": {}},
                         "wsd": {"overrides": {"train.schedule.kind": "wsd",
                                               "train.schedule.decay_steps": 5,
                                               "train.schedule.min_lr_ratio": 0.0}}},
            "axes": {"train.schedule.decay_shape": {"values": ["linear", "1-sqrt"],
                                                    "variants": ["wsd"]}},
            "seeds": [0], "pairs": [["wsd-linear", "cosine"], ["wsd-1-sqrt", "cosine"]],
            "evals": {"tasks": ["heldout"], "depths": [1]}}
    parsed = parse_spec(spec, "spec.yaml")
    assert list(parsed.variants) == ["cosine", "wsd-linear", "wsd-1-sqrt"]
    cfgs = {r.variant: run_config(parsed, r).train for r in expand(parsed)}
    assert (cfgs["cosine"].schedule.kind, cfgs["wsd-1-sqrt"].schedule.kind) == ("cosine", "wsd")
    assert (cfgs["wsd-linear"].schedule.decay_shape, cfgs["wsd-1-sqrt"].schedule.decay_shape) == \
        ("linear", "1-sqrt")
    f = LRSchedule.from_config(cfgs["wsd-1-sqrt"])
    assert f(14) == 1.0 and f(15) == pytest.approx(1 - math.sqrt(0.2)) and f(19) == 0.0

    # overlaps the warmup of 2
    spec["variants"]["wsd"]["overrides"]["train.schedule.decay_steps"] = 19
    with pytest.raises(SpecError) as err:
        check_runs(parse_spec(spec, "spec.yaml"))
    assert str(err.value).startswith("spec.yaml: variants.wsd-linear (run ")
    assert str(err.value).endswith("train.schedule.decay_steps: the wsd decay of 19 steps overlaps "
                                   "the warmup of 2 in train.max_steps=20; it may take at most 18")
