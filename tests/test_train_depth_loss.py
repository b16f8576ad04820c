"""train.loss.depth two_depths (issue 26): the loss at a shorter depth, read out from the same
forward, joins the objective with its weight; the logged loss stays the step depth's; the gradient
is that of loss_T + weight * loss_short; no term where T <= short; off leaves train_step's
objective as it was; the config's refusals; and a real run logs loss_short."""

from __future__ import annotations

import pytest
import torch

from scse_dist.config import load_config
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.train.depth import short_depth_loss
from scse_dist.train.step import train_step
from scse_dist.typed_yaml import ConfigError
from test_train_step import RecordingEngine, windows
from train_procs import read_metrics, run_trainer


def model() -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=3))


def grads(m: LoopedLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("weight", [0.5, 2.0])
def test_the_short_depth_s_loss_joins_the_objective_with_its_weight(weight: float) -> None:
    m = model()
    engine = RecordingEngine(m)
    result = train_step(engine, windows(2), depth=4, short_depth=2, short_weight=weight)
    got = grads(m)
    m.zero_grad()
    long_loss, short_loss = [], []
    for w in windows(2):
        out = m(w[:, :-1], w[:, 1:], depth=4)
        short = m(w[:, :-1], w[:, 1:], depth=2).loss  # a separate run to depth 2: the same number
        (out.loss + weight * short).backward()
        long_loss.append(float(out.loss.detach()))
        short_loss.append(float(short.detach()))
    want = grads(m)
    assert float(result.loss_sum) == pytest.approx(sum(long_loss), rel=1e-6)  # logged: T's alone
    assert float(result.short_loss_sum) == pytest.approx(sum(short_loss), rel=1e-6)
    assert result.short_micro_batches == 2 and result.depth == 4
    backward = [v for kind, v in engine.events if kind == "backward"]
    assert backward == pytest.approx([a + weight * b for a, b in zip(long_loss, short_loss)],
                                     rel=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-7), name


def test_no_term_at_a_step_no_deeper_than_short_and_off_is_as_before() -> None:
    off, at_short = model(), model()
    plain = train_step(RecordingEngine(off), windows(2), depth=2)
    skipped = train_step(RecordingEngine(at_short), windows(2), depth=2, short_depth=2,
                         short_weight=0.5)
    assert plain.short_loss_sum is None and plain.short_micro_batches == 0
    assert float(skipped.short_loss_sum) == 0.0 and skipped.short_micro_batches == 0
    assert torch.equal(plain.loss_sum, skipped.loss_sum)
    for name, g in grads(off).items():
        assert torch.equal(g, grads(at_short)[name]), name
    assert short_depth_loss(load_config(None, []).train) == {}
    cfg = load_config(None, ["train.loss.depth.kind=two_depths", "train.loss.depth.short=3",
                             "train.loss.depth.weight=0.25"])
    assert short_depth_loss(cfg.train) == {"short_depth": 3, "short_weight": 0.25}


@pytest.mark.parametrize("overrides,message", [
    (["train.loss.depth.short=0"], "train.loss.depth.short: must be >= 1, got 0"),
    (["train.loss.depth.weight=0"], "train.loss.depth.weight: must be a finite number > 0"),
    (["model.recurrence=untied"], "train.loss.depth: recurrence=untied runs one fixed depth"),
    (["train.loss.depth.short=4"], "train.loss.depth.short: 4 is not below the largest trained "
                                   "depth 4"),
])
def test_refusals(overrides: list[str], message: str) -> None:
    base = ["train.loss.depth.kind=two_depths", "model.depth=4"]
    with pytest.raises(ConfigError, match="^" + message):
        load_config(None, base + overrides)
    # a weight 0 or a bad short is fine while the term is off
    load_config(None, ["model.depth=4", *[o for o in overrides if "depth_loss" in o]])


def test_a_run_logs_the_short_depth_s_loss(tmp_path, tiny_config, subprocess_env) -> None:
    runs = {}
    for name, extra in (("on", ["train.loss.depth.kind=two_depths", "train.loss.depth.short=1"]),
                        ("off", [])):
        (tmp_path / name).mkdir()
        cfg = tiny_config(tmp_path / name, *extra, "train.max_steps=6", "train.log_every=2",
                          "train.checkpoint.every=100")
        out = run_trainer(cfg, subprocess_env)
        runs[name] = [r for r in read_metrics(tmp_path / name / "runs" / "tiny") if "loss" in r]
        assert ("loss_short " in out) == (name == "on")
    on, off = runs["on"], runs["off"]
    assert [r["step"] for r in on] == [r["step"] for r in off] == [1, 2, 4, 6]
    assert all("loss_short" not in r for r in off)
    # the tiny run draws T in 1..3: a window where some T > 1 has a short loss (NaN otherwise)
    finite = [r["loss_short"] for r in on if r["loss_short"] == r["loss_short"]]
    assert finite and all(3.0 < v < 10.0 for v in finite)
    assert on[0]["loss"] == pytest.approx(off[0]["loss"], rel=1e-6)  # the same first forward
    assert on[-1]["loss"] != pytest.approx(off[-1]["loss"], rel=1e-6)  # a different objective
