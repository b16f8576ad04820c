"""The generated DeepSpeed config, JSON merge, and conflicts between the file and config fields."""

import json
from pathlib import Path

import pytest

from scse_dist.config import ConfigError, load_config
from scse_dist.train.engine import build_ds_config

REPO = Path(__file__).resolve().parents[1]


def cfg_with(*overrides):
    return load_config(None, list(overrides))


def test_generated_values_come_from_the_config():
    ds = build_ds_config(cfg_with("train.micro_batch_size=3", "train.grad_accum_steps=2",
                                  "train.grad_clip=0.5", "train.zero_stage=2", "train.lr=0.01",
                                  "train.beta2=0.99", "train.weight_decay=0.05"), on_cuda=False)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["bf16"] == {"enabled": False}  # auto on CPU resolves to fp32
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.05, "torch_adam": True}}
    assert "scheduler" not in ds  # the LambdaLR is passed to deepspeed.initialize instead


def test_cuda_uses_fused_adam_and_explicit_bf16():
    ds = build_ds_config(cfg_with("train.precision=bf16"), on_cuda=True)
    assert ds["optimizer"]["params"]["torch_adam"] is False
    assert ds["bf16"]["enabled"] is True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_zero_files_merge_over_the_generated_config(stage):
    path = REPO / "configs" / "deepspeed" / f"zero{stage}.json"
    ds = build_ds_config(cfg_with(f"train.zero_stage={stage}", f"train.deepspeed_config={path}"),
                         on_cuda=False)
    file_zero = json.loads(path.read_text())["zero_optimization"]
    assert ds["zero_optimization"] == file_zero
    assert ds["train_micro_batch_size_per_gpu"] == 8  # generated keys survive the merge


def test_conflicting_stage_names_both_the_field_and_the_file():
    path = REPO / "configs" / "deepspeed" / "zero3.json"
    with pytest.raises(ConfigError) as err:
        build_ds_config(cfg_with("train.zero_stage=1", f"train.deepspeed_config={path}"), on_cuda=False)
    msg = str(err.value)
    assert msg.startswith("train.zero_stage:")
    assert "zero_optimization/stage=1" in msg and str(path) in msg and "sets 3" in msg


def test_file_may_repeat_a_field_with_the_same_value_and_add_new_keys(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"gradient_clipping": 1, "optimizer": {"params": {"eps": 1e-6}},
                             "zero_optimization": {"overlap_comm": True}}))
    ds = build_ds_config(cfg_with(f"train.deepspeed_config={f}"), on_cuda=False)
    assert ds["gradient_clipping"] == 1
    assert ds["optimizer"]["params"]["eps"] == 1e-6 and ds["optimizer"]["params"]["lr"] == 1e-3
    assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": True}


@pytest.mark.parametrize("content, field", [
    ({"bf16": {"enabled": True}}, "train.precision"),
    ({"scheduler": {"type": "WarmupLR"}}, "train.lr/warmup_steps/min_lr_ratio"),
    ({"optimizer": {"params": {"betas": [0.9, 0.999]}}}, "train.beta1/train.beta2"),
])
def test_other_conflicts(tmp_path, content, field):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=f"^{field}:"):
        build_ds_config(cfg_with(f"train.deepspeed_config={f}"), on_cuda=False)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="train.deepspeed_config: file .*nope.json.* does not exist"):
        build_ds_config(cfg_with(f"train.deepspeed_config={tmp_path}/nope.json"), on_cuda=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        build_ds_config(cfg_with(f"train.deepspeed_config={bad}"), on_cuda=False)
