"""Loss-spike skipping (train.spike_skip): the running statistics, the config's checks, the
callback's counts, and real runs where an injected spike (SCSE_FAULT=spike@N) is not applied at
ZeRO 0, 1 and 3 on 2 ranks, survives a resume, and too many in a row end the run."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from scse_dist.config import load_config
from scse_dist.train.callbacks.assembly import check_callbacks
from scse_dist.train.callbacks.spike import SpikeSkipCallback
from scse_dist.train.faults import SPIKE_EXIT_CODE, SPIKE_FACTOR, FaultInjector, TrainingStopped
from scse_dist.train.spike import RunningStats, SpikeDetector
from scse_dist.typed_yaml import ConfigError
from train_procs import REPO, TRAIN, all_passed, read_metrics, train_ranks

PROBE = "weights_probe:WeightsAt"

SP = "train.callbacks.spike_skip.init_args"


# --------------------------------------------------------------------------- the statistics


def test_running_stats_are_the_mean_and_sample_std_of_the_last_window_values():
    values = [5.0, 4.5, 4.75, 4.25, 4.0, 4.6, 3.9]
    stats = RunningStats(window=4)
    assert math.isnan(stats.mean) and math.isnan(stats.std)
    stats.add(values[0])
    assert stats.mean == 5.0 and math.isnan(stats.std)  # one value has no spread
    for v in values[1:]:
        stats.add(v)
    assert list(stats.values) == values[-4:]
    assert stats.mean == pytest.approx(statistics.mean(values[-4:]), rel=1e-15)
    assert stats.std == pytest.approx(statistics.stdev(values[-4:]), rel=1e-15)
    assert stats.std == pytest.approx(0.311916121, rel=1e-8)  # by hand: sqrt(0.291875 / 3)


def cfg(**kw) -> SpikeSkipCallback.Config:
    return SpikeSkipCallback.Config(**{"k": 3.0, "window": 5, "warmup": 3, **kw})


def test_a_spike_is_refused_only_after_the_warmup_and_stays_out_of_the_window():
    det = SpikeDetector(cfg(metric="loss"))
    assert det.check(5.0, 1.0) is None and det.check(100.0, 1.0) is None  # warm-up: 2 values
    assert det.check(4.0, 1.0) is None  # 3 values: 5, 100, 4 (the warm-up took the 100)
    det = SpikeDetector(cfg(metric="loss"))
    for loss in (5.0, 4.8, 5.2):
        assert det.check(loss, 1.0) is None
    # mean 5.0, std 0.2: 5.0 + 3 * 0.2 = 5.6 is the threshold
    assert det.check(5.59, 1.0) is None
    spike = det.check(7.0, 1.0)
    assert spike is not None and (spike.metric, spike.value) == ("loss", 7.0)
    assert list(det.stats["loss"].values) == [5.0, 4.8, 5.2, 5.59]  # the 7.0 did not join
    assert spike.mean == pytest.approx(statistics.mean([5.0, 4.8, 5.2, 5.59]))
    assert spike.std == pytest.approx(statistics.stdev([5.0, 4.8, 5.2, 5.59]))
    assert spike.describe().startswith("loss 7 > mean 5.147 + 3 x std 0.3")
    assert det.check(7.0, 1.0) is not None  # a second one is refused too: no widening
    assert det.check(-50.0, 1.0) is None  # only upward spikes are refused


@pytest.mark.parametrize("metric,refused", [("loss", [False, True]), ("grad_norm", [True, False]),
                                            ("both", [True, True])])
def test_the_metric_decides_what_is_watched(metric, refused):
    det = SpikeDetector(cfg(metric=metric))
    for loss, norm in ((5.0, 1.0), (5.1, 1.1), (4.9, 0.9)):
        assert det.check(loss, norm) is None
    got = []
    for loss, norm in ((5.0, 50.0), (50.0, 1.0)):  # a gradient spike, then a loss spike
        spike = det.check(loss, norm)
        got.append(spike is not None)
    assert got == refused
    assert set(det.state_dict()) == {"loss": {"loss"}, "grad_norm": {"grad_norm"},
                                     "both": {"loss", "grad_norm"}}[metric]


def test_state_round_trip_and_a_smaller_window_keeps_the_newest_values():
    det = SpikeDetector(cfg(window=5))
    for i in range(7):
        det.check(5.0 + 0.1 * i, 1.0 + 0.01 * i)
    state = json.loads(json.dumps(det.state_dict()))  # plain values, as a checkpoint keeps them
    again = SpikeDetector(cfg(window=5))
    again.load_state_dict(state)
    assert again.state_dict() == det.state_dict()
    assert again.stats["loss"].std == det.stats["loss"].std
    smaller = SpikeDetector(cfg(window=3))
    smaller.load_state_dict(state)
    assert smaller.state_dict()["loss"] == pytest.approx([5.4, 5.5, 5.6])
    watched_late = SpikeDetector(cfg(metric="both"))
    watched_late.load_state_dict({"loss": state["loss"]})  # grad_norm was not watched before
    assert len(watched_late.stats["loss"]) == 5 and len(watched_late.stats["grad_norm"]) == 0


# --------------------------------------------------------------------------- config and faults


@pytest.mark.parametrize("override,message", [
    ("k=0", f"{SP}.k: must be a finite number > 0, got 0"),
    ("k=.nan", f"{SP}.k: must be a finite number > 0, got nan"),
    ("window=1", f"{SP}.window: must be >= 2"),
    ("warmup=1", f"{SP}.warmup: must lie in [2, window=128], got 1"),
    ("warmup=200", f"{SP}.warmup: must lie in [2, window=128], got 200"),
    ("max_in_a_row=0", f"{SP}.max_in_a_row: must be >= 1, got 0"),
    ("metric=norm", f"{SP}.metric"),
])
def test_bad_spike_skip_fields_are_named(override, message):
    cfg = load_config(None, ["train.callbacks.spike_skip.enabled=true", f"{SP}.{override}"])
    with pytest.raises(ConfigError) as err:
        check_callbacks(cfg)
    assert message in str(err.value)


def test_muon_at_zero_1_or_2_is_refused_with_spike_skipping():
    base = ["train.optimizer.kind=muon", "train.callbacks.spike_skip.enabled=true"]
    with pytest.raises(ConfigError, match=r"^train.callbacks.spike_skip: not with "
                                           "train.optimizer.kind: "
                                          r"muon at train.engine.zero_stage 1"):
        check_callbacks(load_config(None, base))
    at_zero_0 = check_callbacks(load_config(None, [*base, "train.engine.zero_stage=0"]))
    assert any(isinstance(config, SpikeSkipCallback.Config) for _, _, config in at_zero_0)


def test_the_spike_fault_multiplies_the_loss_on_its_step_and_rank():
    injector = FaultInjector(rank=1, spec="spike@3:rank1,spike@4:rank0")
    two = torch.tensor(2.0)
    assert float(injector.loss(3, two)) == 2.0 * SPIKE_FACTOR
    assert float(injector.loss(4, two)) == 2.0 and float(injector.loss(2, two)) == 2.0


# --------------------------------------------------------------------------- the step's gate


class StageZeroEngine:
    """What DeepSpeed's engine does at ZeRO-0 in fp32 around a plain torch optimizer: backward
    accumulates, step() at the boundary clips, steps the optimizer, clears the gradients and
    steps the LR scheduler (torch's, which keeps a wrapper of optimizer.step on the instance)."""

    def __init__(self, module: torch.nn.Module, accum: int = 2, clip: float = 0.01) -> None:
        self.module, self.accum, self.clip, self.device = module, accum, clip, torch.device("cpu")
        self.optimizer = self.basic_optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.micro = 0

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def zero_optimization_stage(self) -> int:
        return 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, objective: torch.Tensor) -> None:
        (objective / self.accum).backward()

    def step(self) -> None:
        self.micro += 1
        if self.micro % self.accum:
            return
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def was_step_applied(self) -> bool:
        return True


# the refused first step never calls AdamW's step, which torch's scheduler notices
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_the_gate_sees_the_norm_before_clipping_and_a_refusal_leaves_weights_and_state():
    from scse_dist.model import LoopedLM
    from scse_dist.model.config import ModelConfig
    from scse_dist.train.step import train_step

    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=2))
    engine = StageZeroEngine(model)
    tracker = vars(engine.optimizer)["step"]  # the LR scheduler's wrapper
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(2)]
    # what the gate must be shown: the mean loss, and the norm of the mean gradient, unclipped
    outs = [model(w[:, :-1], w[:, 1:], depth=2) for w in windows]
    sum(o.loss for o in outs).div(2).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    assert norm > 10 * engine.clip  # so clipping would have changed it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def refuse(loss, grad_norm):
        seen.append((loss, grad_norm))
        return False

    result = train_step(engine, windows, depth=2, update_gate=refuse)
    assert seen == [(pytest.approx(sum(float(o.loss.detach()) for o in outs) / 2, rel=1e-6),
                     pytest.approx(norm, rel=1e-5))]
    assert (result.refused, result.skipped, result.grad_norm) == (True, False, seen[0][1])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert engine.optimizer.state == {}  # AdamW never stepped: no moments, no step count
    assert vars(engine.optimizer)["step"] is tracker  # the scheduler's wrapper put back
    assert engine.scheduler.last_epoch == 1  # the schedule advanced
    assert all(p.grad is None for p in model.parameters())  # the gradients were cleared

    result = train_step(engine, windows, depth=2, update_gate=lambda loss, grad_norm: True)
    assert not result.refused and len(engine.optimizer.state) > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- the callback


def fake_state(step: int, skipped: bool = False):
    return SimpleNamespace(step=step, rank0=True, last_saved=4, spike_skips=None,
                           result=SimpleNamespace(skipped=skipped))


def test_the_callback_counts_streaks_and_stops_with_its_own_exit_status(capsys):
    callback = SpikeSkipCallback(cfg(metric="loss", max_in_a_row=2))
    losses = {1: 5.0, 2: 5.1, 3: 4.9, 4: 50.0, 5: 5.0, 6: 60.0, 7: math.nan, 8: 70.0}
    for step in range(1, 8):
        state = fake_state(step, skipped=step == 7)
        if step != 7:  # a non-finite step asks no gate
            assert callback.allow_update(state, losses[step], 1.0) == (step not in (4, 6))
        callback.on_step_end(state)
    assert callback.state_dict()["total"] == 2 and callback.in_a_row == 1  # 7 did not end it
    assert "step 4: loss spike (loss 50 > mean 5 + 3 x std 0.1), step skipped (1 in a row, " \
           "1 in all)" in capsys.readouterr().out
    state = fake_state(8)
    assert not callback.allow_update(state, losses[8], 1.0)
    with pytest.raises(TrainingStopped) as stop:
        callback.on_step_end(state)
    assert stop.value.exit_code == SPIKE_EXIT_CODE == 4
    assert str(stop.value) == ("step 8: 2 loss spikes in a row (train.callbacks.spike_skip."
                               "init_args.max_in_a_row=2); "
                               "stopping without saving, last good checkpoint: step-0000004")
    assert state.spike_skips == 3


# --------------------------------------------------------------------------- real runs

SPIKE = ("train.spike_skip.enabled=true", "train.spike_skip.warmup=4",
         "train.spike_skip.window=16", "train.log_every=1")


def probe(out, steps=()) -> str:
    return f"train.callbacks.probe={{class_path: {PROBE}, init_args: {{out: '{out}', " \
           f"steps: {list(steps)}}}}}"


@pytest.fixture
def env(subprocess_env):
    return dict(subprocess_env, PYTHONPATH=f"{REPO}:{REPO / 'tests'}")


def probed(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (3, "fp32"), (1, "bf16")])
def test_a_spike_on_one_rank_is_skipped_on_both_and_the_weights_stay(tmp_path, tiny_config, env,
                                                                     stage, precision):
    # bf16 at ZeRO-1 is DeepSpeed's BF16_Optimizer, another wrapper around the torch optimizer
    out = tmp_path / "probe"
    config = tiny_config(tmp_path, *SPIKE, "train.spike_skip.metric=grad_norm",
                         f"train.engine.zero_stage={stage}", f"train.engine.precision={precision}",
                         "train.max_steps=10", probe(out, (7, 8, 9)))
    # Only rank 1's loss (and so its gradients) is 1000x at step 8; the reduced gradient spikes.
    results = train_ranks(config, env, extra_env={"SCSE_FAULT": "spike@8:rank1"})
    stdout = all_passed(results)
    assert "step 8: loss spike (grad_norm " in stdout and \
        "step skipped (1 in a row, 1 in all)" in stdout
    assert "loss spike" not in results[1].stdout  # said once, by rank 0
    rows = [r for r in read_metrics(tmp_path / "runs" / "tiny") if "loss" in r]
    assert [r["spike_skips"] for r in rows] == [0] * 7 + [1] * 3
    assert all(r["skipped_steps"] == 0 for r in rows)
    before, after, next_ = (load_file(str(out / f"step-{s}.safetensors")) for s in (7, 8, 9))
    assert all(torch.equal(before[k], after[k]) for k in before)  # step 8 was not applied
    assert any(not torch.equal(after[k], next_[k]) for k in after)  # step 9 was
    steps = probed(out)
    assert [s for s, r in steps.items() if r["refused"]] == [8]
    norms = [steps[s]["grad_norm"] for s in range(1, 8)]
    assert steps[8]["grad_norm"] > 100 * max(norms)
    assert steps[8]["loss"] > 100 * steps[7]["loss"]  # the mean over ranks: ~500x
    if stage < 3:  # the global norm before clipping, as loop diagnostics measure it (not at 3)
        assert [r["diag/grad_norm"] for r in rows] == pytest.approx(
            [steps[s]["grad_norm"] for s in range(1, 11)], rel=1e-4)


def run(config, env, faults="", *overrides):
    return subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], cwd=REPO,
                          env=dict(env, SCSE_FAULT=faults), capture_output=True, text=True,
                          timeout=300)


def spike_state(run_dir, tag="step-0000012") -> dict:
    states = torch.load(run_dir / "checkpoints" / tag / "mp_rank_00_model_states.pt",
                        weights_only=False)["callbacks"]
    return states["scse_dist.train.callbacks.spike:SpikeSkipCallback"]


@pytest.mark.slow
def test_the_statistics_survive_a_resume(tmp_path, tiny_config, env):
    steps = (*SPIKE, "train.spike_skip.warmup=5", "train.max_steps=12", "train.checkpoint.every=4")
    (tmp_path / "ref").mkdir()
    reference = tiny_config(tmp_path / "ref", *steps)
    done = run(reference, env, "spike@9")
    assert done.returncode == 0, done.stderr[-3000:]
    want = spike_state(tmp_path / "ref" / "runs" / "tiny")
    assert want["total"] == 1 and len(want["stats"]["loss"]) == 11  # 12 steps, one refused

    config = tiny_config(tmp_path, *steps)
    first = run(config, env, "spike@9,sigterm@6")
    assert first.returncode == 75, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert len(spike_state(run_dir, "step-0000006")["stats"]["loss"]) == 6
    # Resumed at 6: fresh statistics would still be warming up (2 of 5 values) at step 9.
    second = run(config, env, "spike@9")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "step 9: loss spike (loss " in second.stdout
    assert spike_state(run_dir) == want  # the same windows, to the bit, and the same counts
    assert [r["spike_skips"] for r in read_metrics(run_dir) if "loss" in r] == \
        [0] * 8 + [1] * 4


@pytest.mark.slow
def test_too_many_spikes_in_a_row_end_the_run_with_one_line_and_status_4(tmp_path, tiny_config,
                                                                         env):
    config = tiny_config(tmp_path, *SPIKE, "train.spike_skip.max_in_a_row=2",
                         "train.max_steps=12", "train.checkpoint.every=4")
    out = run(config, env, "spike@6,spike@7")
    assert out.returncode == SPIKE_EXIT_CODE, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "in a row" in line]
    assert lines == [f"scse-train: step 7: 2 loss spikes in a row ({SP}.max_in_a_row=2); "
                     "stopping without saving, last good checkpoint: step-0000004"]
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step-0000004"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step-0000004"]
    kept = spike_state(tmp_path / "runs" / "tiny", "step-0000004")
    assert (kept["total"], kept["in_a_row"], len(kept["stats"]["loss"])) == (0, 0, 4)
    # step 7 stopped the run before its row: the row of step 6 has the first spike
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert [r["spike_skips"] for r in rows if "loss" in r] == [0] * 5 + [1]
