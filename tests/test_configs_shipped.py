"""Every shipped run config trains, exports and evaluates through `python launch/train.py`.

Each YAML under configs/ runs as a user runs it, from a directory outside the checkout (the paths
a config writes resolve against its own directory: docs/config.md, "Paths in config files"),
with only its sizes shrunk: width, heads, vocabulary,
sequence length (a batch in tokens with it: the same sequences), steps, evaluation batches, and
the data and output paths. Everything else (gradient accumulation, micro-batch, DeepSpeed JSON,
ZeRO stage, activation checkpointing, depth sampling, eval depths, after-train evaluation,
wandb) is the config's own, and the test checks that the run's resolved config.yaml still says
so. A config added to configs/ is picked up here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_VOCAB
from scse_dist.config import RunConfig, config_to_dict, load_config

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed presets are JSON; configs/studies/ holds study specs (tests/test_study.py), not runs.
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "studies" not in p.parts)
MIN_STEPS = 3

# The size of each shrunk field: a config keeps its own value where it is already at most this.
TINY_SIZES = {
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.vocab_size": TINY_VOCAB,
    "model.max_seq_len": 32,
    "data.seq_len": 32,
    "train.max_steps": MIN_STEPS,
    "train.schedule.warmup_steps": 1,
    "train.log_every": 1,  # one metrics row per step
    "eval.batch_size": 4,
    "eval.max_batches": 2,
}
# Only where the config sets it: 0 (the default) derives the width from the shrunk d_model.
TINY_FFN_HIDDEN = 64

pytestmark = pytest.mark.slow


def _get(cfg: RunConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def size_overrides(config: Path, data: dict[str, str], output_dir: Path) -> list[str]:
    """The `key=value` overrides that shrink `config` to test size; nothing else changes."""
    cfg = load_config(config)
    sizes = {k: min(_get(cfg, k), tiny) for k, tiny in TINY_SIZES.items()}
    # max_batches 0 means "the whole split": not smaller, so it gets the tiny value too.
    sizes["eval.max_batches"] = min(cfg.eval.max_batches or TINY_SIZES["eval.max_batches"],
                                    TINY_SIZES["eval.max_batches"])
    if cfg.model.ffn_hidden:
        sizes["model.ffn_hidden"] = TINY_FFN_HIDDEN
    if cfg.train.batch.global_batch_tokens:  # the same sequences per step, of the shrunk length
        sizes["train.batch.global_batch_tokens"] = \
            cfg.train.batch.global_batch_size * sizes["data.seq_len"]
    sizes.update({"data.path": data["path"], "data.tokenizer": data["tokenizer"],
                  "output_dir": str(output_dir)})
    if cfg.data.mixture_paths:
        sizes["data.mixture_paths"] = [data["path"]] * len(cfg.data.mixture_paths)
    return [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in sizes.items()]


def test_the_glob_finds_the_shipped_configs():
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert {"quickstart.yaml", "tiny-cpu.yaml", "gpt2-small-scse.yaml", "gpt2-small-additive.yaml",
            "gpt2-small-untied.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_shipped_config_trains_exports_and_evaluates(config, tmp_path, tiny_data, user_env):
    overrides = size_overrides(config, tiny_data, tmp_path / "runs")
    user_cfg = load_config(config)
    want = load_config(config, overrides)
    out = subprocess.run([sys.executable, str(REPO / "launch/train.py"), "--config", str(config),
                          *overrides],
                         cwd=tmp_path, env=user_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}"
    run_dir = tmp_path / "runs" / want.name

    # What ran is the user's config except the overridden sizes (accumulation, ZeRO, DeepSpeed
    # JSON, checkpointing, depth sampling, eval, wandb all as shipped).
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    # the run writes down the accumulation it derived from a global batch at its world size, 1
    expected, user = config_to_dict(want), config_to_dict(user_cfg)
    expected["train"]["batch"]["grad_accum_steps"] = user["train"]["batch"]["grad_accum_steps"] = \
        want.train.batch.grad_accum_for(1)
    if want.model.activation_checkpointing == "auto":  # written down as the run resolved it
        resolved = ran["model"]["activation_checkpointing"]
        assert resolved in ("none", "loop")
        expected["model"]["activation_checkpointing"] = resolved
        user["model"]["activation_checkpointing"] = resolved
    assert ran == expected
    changed = {k for k, v in _flat(user).items() if _flat(ran)[k] != v}
    assert changed <= {o.split("=", 1)[0] for o in overrides}
    assert ran["train"]["batch"]["grad_accum_steps"] == user_cfg.train.batch.grad_accum_for(1)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, want.train.max_steps + 1))
    assert want.train.max_steps >= MIN_STEPS
    assert all(math.isfinite(r["loss"]) and r["skipped_steps"] == 0 for r in rows)
    t = user_cfg.train
    # Every micro-batch of the accumulation was consumed: tokens = steps x micro x accum x seq.
    assert rows[-1]["tokens"] == want.train.max_steps * t.batch.micro_batch_size * \
        t.batch.grad_accum_for(1) * want.data.seq_len
    assert f"ZeRO-{t.engine.zero_stage}" in out.stdout

    assert (run_dir / "export" / "model.safetensors").is_file()
    assert yaml.safe_load((run_dir / "export" / "config.yaml").read_text())["name"] == want.name
    heldout = run_dir / "eval" / "heldout.json"
    if user_cfg.eval.after_train:
        results = json.loads(heldout.read_text())["results"]
        # An untied model has one depth of its own and is evaluated there only.
        depths = [user_cfg.model.depth] if user_cfg.model.recurrence == "untied" \
            else sorted(set(user_cfg.eval.depths))
        assert [r["depth"] for r in results] == depths
        assert all(math.isfinite(r["ppl"]) for r in results)
    else:
        assert not heldout.exists()
    if user_cfg.wandb.enabled and user_cfg.wandb.mode != "disabled":
        assert list((run_dir / "wandb").glob(f"{user_cfg.wandb.mode}-run-*"))
