"""train.optimizer.lr_mult: per-parameter-group LR multipliers in AdamW (torch, DeepSpeed's
groups, Muon's AdamW half): a group's update scales with its factor, the rest and weight decay
stay."""

from __future__ import annotations

import pytest
import torch

from scse_dist.config import load_config
from scse_dist.model import LoopedLM, ModelConfig
from scse_dist.param_groups import group_of
from scse_dist.train.config import TrainConfig
from scse_dist.train.diagnostics import update_ratios, weights_snapshot
from scse_dist.train.engine import _param_groups, build_optimizer
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule import build_lr_scheduler
from scse_dist.train.schedule_config import ScheduleConfig
from scse_dist.typed_yaml import ConfigError
from train_procs import read_metrics, run_trainer

MODEL = ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=2)
TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))


def one_step(*overrides: str) -> tuple[LoopedLM, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """A fresh model (seed 0), one AdamW step on TOKENS: (model, weights before, optimizer)."""
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_heads=2",
                             "model.max_seq_len=32", "model.depth=2", "data.seq_len=32",
                             "train.optimizer.lr=0.01", *overrides])
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    optimizer = build_optimizer(cfg.train.optimizer, model, on_cuda=False)
    model(TOKENS[:, :-1], TOKENS[:, 1:], keep_logits=False).loss.backward()
    before = weights_snapshot(model)
    optimizer.step()
    return model, before, optimizer


def test_a_groups_update_scales_with_its_multiplier() -> None:
    base, before, _ = one_step()
    scaled, before_scaled, optimizer = one_step("train.optimizer.lr_mult.core_mlp=0.5",
                                                "train.optimizer.lr_mult.anchor=3",
                                                "train.optimizer.lr_mult.norm=0")
    factor = {"core_mlp": 0.5, "anchor": 3.0, "norm": 0.0}
    for (name, p), (_, q) in zip(base.named_parameters(), scaled.named_parameters()):
        assert torch.equal(before[name], before_scaled[name])  # the same start
        want = (p.detach() - before[name]) * factor.get(group_of(name), 1.0)
        torch.testing.assert_close(q.detach() - before[name], want, rtol=1e-5, atol=1e-9,
                                   msg=name)
    assert all(torch.equal(q.detach(), before[n]) for n, q in scaled.named_parameters()
               if group_of(n) == "norm")  # factor 0: frozen exactly
    ratios = update_ratios(scaled, before_scaled)
    assert ratios["diag/update_ratio_anchor"] == pytest.approx(
        3 * update_ratios(base, before)["diag/update_ratio_anchor"], rel=1e-5)
    # the matrices' group split three ways, the gains' (all norms) moved whole to factor 0;
    # weight decay unchanged per group, train.optimizer.lr's group first (the log's lr)
    groups = optimizer.param_groups
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [
        (0.01, 0.1), (0.005, 0.1), (0.03, 0.1), (0.0, 0.0)]


def test_no_multipliers_leave_the_groups_as_they_were() -> None:
    model = LoopedLM(MODEL)
    groups = _param_groups(model, 0.1, 0.01, {})
    assert [(len(g["params"]), g["weight_decay"], "lr" in g) for g in groups] == [
        (len([p for p in model.parameters() if p.dim() >= 2]), 0.1, False),
        (len([p for p in model.parameters() if p.dim() < 2]), 0.0, False)]


def test_the_schedule_scales_every_group_alike() -> None:
    model = LoopedLM(MODEL)
    train = TrainConfig(optimizer=OptimizerConfig(lr=0.01, lr_mult={"embed": 2.0}),
                        schedule=ScheduleConfig(warmup_steps=4))
    opt = train.optimizer
    optimizer = torch.optim.AdamW(_param_groups(model, 0.1, opt.lr, opt.lr_mult), lr=opt.lr)
    build_lr_scheduler(optimizer, train)
    assert sorted(g["lr"] for g in optimizer.param_groups) == pytest.approx([0.0025, 0.0025,
                                                                             0.005])


def test_muon_scales_its_adamw_half_only() -> None:
    from scse_dist.train.muon import build_muon

    model = LoopedLM(MODEL)
    opt = OptimizerConfig(kind="muon", lr=0.01, lr_mult={"embed": 2.0, "norm": 0.5})
    lrs = {(g["use_muon"], g["lr"]) for g in build_muon(model, opt, False).param_groups}
    assert lrs == {(False, 0.02), (False, 0.005), (True, opt.muon_lr)}
    with pytest.raises(ConfigError, match="train.optimizer.lr_mult.core_mlp: no parameter that "
                       "train.optimizer.kind: muon's AdamW half updates is in group core_mlp"):
        build_muon(model, OptimizerConfig(kind="muon", lr_mult={"core_mlp": 0.5}), False)


def test_bad_multipliers_say_so_in_one_line() -> None:
    with pytest.raises(ConfigError, match="train.optimizer.lr_mult: unknown parameter group "
                                          "'core_mpl'; "
                       "did you mean core_mlp\\?"):
        load_config(None, ["train.optimizer.lr_mult.core_mpl=0.5"])
    with pytest.raises(ConfigError, match="train.optimizer.lr_mult.norm: must be a finite "
                                          "multiplier >= 0"):
        load_config(None, ["train.optimizer.lr_mult.norm=-1"])
    with pytest.raises(ConfigError, match="train.optimizer.lr_mult.head: no parameter that AdamW "
                                          "updates "
                       "is in group head"):  # tied embeddings: the head is embed
        _param_groups(LoopedLM(MODEL), 0.1, 0.01, {"head": 0.5})


@pytest.mark.slow
def test_through_deepspeed_zero1_the_first_step_scales(tmp_path, tiny_config, subprocess_env):
    """One step of the real trainer at ZeRO-1 (DeepSpeed's partitioned optimizer over the split
    groups), with and without multipliers: the logged update ratios of step 1 scale exactly."""
    rows = {}
    for name, mult in (("base", []), ("mult", ["train.optimizer.lr_mult.anchor=0.5",
                                              "train.optimizer.lr_mult.norm=0"])):
        directory = tmp_path / name
        directory.mkdir()
        cfg = tiny_config(directory, "train.max_steps=1", "train.log_every=1",
                          "train.engine.zero_stage=1", "train.diagnostics_every=1", *mult)
        run_trainer(cfg, subprocess_env)
        rows[name] = read_metrics(directory / "runs" / "tiny")[0]
    base, mult = rows["base"], rows["mult"]
    assert mult["diag/update_ratio_anchor"] == pytest.approx(
        0.5 * base["diag/update_ratio_anchor"], rel=1e-5)
    assert mult["diag/update_ratio_norm"] == 0.0 < base["diag/update_ratio_norm"]
    assert mult["diag/update_ratio_core_mlp"] == pytest.approx(
        base["diag/update_ratio_core_mlp"], rel=1e-6)
    assert mult["lr"] == base["lr"]  # group 0 is at train.optimizer.lr


def test_a_resume_may_change_factors_not_the_split() -> None:
    from scse_dist.checkpoint.resume import refused_changes
    from scse_dist.config import read_saved_config

    def config(lr_mult: dict) -> dict:
        return {"train": {"optimizer": {"lr_mult": lr_mult}}}

    saved = config({"anchor": 0.5})
    assert refused_changes(saved, config({"anchor": 0.0, "embed": 1.0})) == []
    assert refused_changes({"train": {}}, config({"norm": 1.0})) == []
    assert refused_changes(saved, config({})) == [
        "train.optimizer.lr_mult: {'anchor': 0.5} -> {} (regroups the optimizer's parameters; a "
        "resume may change the factors, not which groups share one)"]
    both = config({"anchor": 0.5, "norm": 0.5})
    assert refused_changes(saved, both) != []  # anchor and norm now share one group
    # a checkpoint saved before train.optimizer was a section: its flat train.lr_mult is read
    flat = read_saved_config({"train": {"lr_mult": {"anchor": 0.5}}})
    assert refused_changes(flat, both) != []
    assert refused_changes(flat, config({"anchor": 1.5})) == []


@pytest.mark.slow
def test_resumed_with_new_factors_they_apply(tmp_path, tiny_config, subprocess_env):
    """ZeRO-1: 2 steps with the anchor at half the rate, resumed at step 2 with it frozen (the
    same split): step 3 leaves it; a resume that regroups is refused in one line."""
    import subprocess
    import sys

    from train_procs import REPO, TRAIN

    cfg = tiny_config(tmp_path, "train.max_steps=2", "train.checkpoint.every=2",
                      "train.engine.zero_stage=1", "train.optimizer.lr_mult.anchor=0.5")
    run_trainer(cfg, subprocess_env)
    run_trainer(cfg, subprocess_env, "train.max_steps=3", "train.optimizer.lr_mult.anchor=0",
                "train.diagnostics_every=1", "train.log_every=1", "train.checkpoint.every=100")
    row = read_metrics(tmp_path / "runs" / "tiny")[-1]
    assert row["step"] == 3 and row["diag/update_ratio_anchor"] == 0.0
    assert row["diag/update_ratio_core_mlp"] > 0
    # step 3's checkpoint has the anchor at 0: anchor and norm at 0.5 would share a group
    out = subprocess.run([sys.executable, TRAIN, "--config", cfg, "train.max_steps=4",
                          "train.optimizer.lr_mult.norm=0.5"], cwd=REPO, env=subprocess_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("train.optimizer.lr_mult: {'anchor': 0.0} -> {'anchor': 0.5, 'norm': 0.5} (regroups "
            "the optimizer's parameters") in out.stderr
