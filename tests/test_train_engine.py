"""The generated DeepSpeed config, JSON merge, and conflicts between the file and config fields."""

import json
from pathlib import Path

import pytest
import torch

from scse_dist.config import load_config
from scse_dist.model import LoopedLM
from scse_dist.train.engine import build_ds_config, build_optimizer
from scse_dist.typed_yaml import ConfigError

REPO = Path(__file__).resolve().parents[1]


def cfg_with(*overrides):
    return load_config(None, list(overrides))


def ds_config(cfg, on_cuda):
    """build_ds_config of a run config's train section and run dir."""
    return build_ds_config(cfg.train, cfg.run_dir, on_cuda=on_cuda)


def test_generated_values_come_from_the_config():
    ds = ds_config(cfg_with("train.batch.micro_batch_size=3",
                                  "train.batch.grad_accum_steps=2",
                                  "train.optimizer.grad_clip=0.5", "train.engine.zero_stage=2",
                                  "train.optimizer.lr=0.01",
                                  "train.optimizer.beta2=0.99",
                                  "train.optimizer.weight_decay=0.05"), on_cuda=False)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"] == {"enabled": False}  # auto on CPU resolves to fp32
    assert "optimizer" not in ds  # torch's AdamW is passed to deepspeed.initialize instead
    assert "scheduler" not in ds  # and so is the LambdaLR


def test_optimizer_is_torch_adamw_fused_on_cuda_with_no_decay_on_norms():
    cfg = cfg_with("train.optimizer.lr=0.01", "train.optimizer.beta2=0.99",
                   "train.optimizer.weight_decay=0.05")
    model = LoopedLM(cfg.model)
    for on_cuda, fused in ((True, True), (False, None)):
        opt = build_optimizer(cfg.train.optimizer, model, on_cuda=on_cuda)
        assert type(opt) is torch.optim.AdamW
        assert opt.defaults["fused"] is fused  # fused: torch's own kernel, no nvcc/JIT build
        assert opt.defaults["lr"] == 0.01 and opt.defaults["betas"] == (0.9, 0.99)
        decay, rest = opt.param_groups
        assert decay["weight_decay"] == 0.05 and rest["weight_decay"] == 0.0
        assert all(p.dim() >= 2 for p in decay["params"]) and \
            all(p.dim() < 2 for p in rest["params"])
        assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    # fused=True really steps on these parameters (torch's fused AdamW also runs on CPU)
    opt = build_optimizer(cfg.train.optimizer, model, on_cuda=True)
    model(torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))).loss.backward()
    before = model.embed.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.embed.weight)


def test_deepspeed_fused_adam_is_opt_in_and_needs_cuda():
    cfg = cfg_with("train.optimizer.kind=deepspeed_fused_adam", "train.engine.precision=bf16")
    ds = ds_config(cfg, on_cuda=True)
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    assert ds["bf16"]["enabled"] is True
    # DeepSpeed builds it
    assert build_optimizer(cfg.train.optimizer, LoopedLM(cfg.model), on_cuda=True) is None
    with pytest.raises(ConfigError, match="^train.optimizer.kind: deepspeed_fused_adam needs a "
                                          "CUDA"):
        ds_config(cfg, on_cuda=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_zero_files_merge_over_the_generated_config(stage):
    path = REPO / "configs" / "deepspeed" / f"zero{stage}.json"
    ds = ds_config(cfg_with(f"train.engine.zero_stage={stage}",
                                  f"train.engine.deepspeed_config={path}"),
                         on_cuda=False)
    file_zero = json.loads(path.read_text())["zero_optimization"]
    assert ds["zero_optimization"] == file_zero
    assert ds["train_micro_batch_size_per_gpu"] == 8  # generated keys survive the merge


def test_conflicting_stage_names_both_the_field_and_the_file():
    path = REPO / "configs" / "deepspeed" / "zero3.json"
    with pytest.raises(ConfigError) as err:
        ds_config(cfg_with("train.engine.zero_stage=1",
                                 f"train.engine.deepspeed_config={path}"),
                        on_cuda=False)
    msg = str(err.value)
    assert msg.startswith("train.engine.zero_stage:")
    assert "zero_optimization/stage=1" in msg and str(path) in msg and "sets 3" in msg


def test_file_may_repeat_a_field_with_the_same_value_and_add_new_keys(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"gradient_clipping": 1, "optimizer": {"params": {"eps": 1e-6}},
                             "zero_optimization": {"overlap_comm": True}}))
    ds = ds_config(cfg_with(f"train.engine.deepspeed_config={f}",
                                  "train.optimizer.kind=deepspeed_fused_adam"), on_cuda=True)
    assert ds["gradient_clipping"] == 1
    assert ds["optimizer"]["params"]["eps"] == 1e-6 and ds["optimizer"]["params"]["lr"] == 1e-3
    assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    with pytest.raises(ConfigError, match="^train.optimizer.kind: .*ds.json has an 'optimizer' "
                                          "section"):
        ds_config(cfg_with(f"train.engine.deepspeed_config={f}"), on_cuda=False)


@pytest.mark.parametrize("content, field", [
    ({"bf16": {"enabled": True}}, "train.engine.precision"),
    ({"scheduler": {"type": "WarmupLR"}}, "train.optimizer.lr/train.schedule"),
    ({"optimizer": {"params": {"betas": [0.9, 0.999]}}}, "train.optimizer.beta1/beta2"),
])
def test_other_conflicts(tmp_path, content, field):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=f"^{field}:"):
        ds_config(cfg_with(f"train.engine.deepspeed_config={f}",
                                 "train.optimizer.kind=deepspeed_fused_adam"), on_cuda=True)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError,
                       match="train.engine.deepspeed_config: file .*nope.json.* does not exist"):
        ds_config(cfg_with(f"train.engine.deepspeed_config={tmp_path}/nope.json"),
                        on_cuda=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        ds_config(cfg_with(f"train.engine.deepspeed_config={bad}"), on_cuda=False)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_fused_adamw_with_rates_and_update_clip_steps_as_unfused_through_deepspeed(stage,
                                                                                   subprocess_env):
    """The CUDA optimizer on CPU: torch's fused AdamW (build_optimizer's choice on CUDA), with
    per-group rates and update clipping, inside the DeepSpeed engine, steps as the unfused one
    (tests/fused_adamw_probe.py; measured 8.9e-8 apart after 4 steps at lr 0.01 at ZeRO-1)."""
    import subprocess
    import sys

    overrides = ["model.d_model=32", "model.n_heads=2", "model.vocab_size=64", "data.seq_len=16",
                 "model.depth=2", "train.batch.micro_batch_size=2",
                 "train.batch.grad_accum_steps=2",
                 f"train.engine.zero_stage={stage}", "train.optimizer.update_clip=0.5",
                 "train.optimizer.lr=0.01",
                 "train.schedule.warmup_steps=0", "train.optimizer.lr_mult.anchor=0.5",
                 "train.optimizer.lr_mult.norm=0",
                 "train.optimizer.lr_mult.embed=2"]
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fused_adamw_probe.py"),
                          *overrides], capture_output=True, text=True, env=subprocess_env,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fused"] == [False, True] and got["clipped"]
    assert got["max_abs"] <= 1e-6 * got["max_param"], got
