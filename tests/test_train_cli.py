"""scse-train's own flags: --help (exit statuses, docs, shipped configs), --print-config and
--dry-run (facts of the run, nothing created, no DeepSpeed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from scse_dist.config import config_to_dict, load_config
from scse_dist.train.cli import main
from train_procs import REPO


def test_help_lists_exit_statuses_the_config_docs_and_the_shipped_configs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for status in ("0 ", "2 ", "3 ", "65 ", "66 ", "74 ", "75 ", "130 "):
        assert f"\n  {status}" in out, status
    assert "docs/config.md" in out and "--dry-run" in out and "--print-config" in out
    assert "quickstart.yaml" in out and "tiny-cpu.yaml" in out
    assert (REPO / "docs" / "config.md").is_file()


def test_print_config_is_the_resolved_yaml_with_overrides(tmp_path, tiny_config, capsys):
    path = tiny_config(tmp_path)
    assert main(["--config", path, "--print-config", "train.max_steps=7",
                 "eval.every_steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == config_to_dict(load_config(path, ["train.max_steps=7", "eval.every_steps=3"]))
    assert printed["train"]["max_steps"] == 7
    assert not (tmp_path / "runs").exists()


def test_print_config_with_a_bad_field_is_one_line_and_exit_2(tmp_path, tiny_config, capsys):
    assert main(["--config", tiny_config(tmp_path), "--print-config", "train.max_stepz=7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.max_stepz" in err[0]


@pytest.mark.slow
def test_dry_run_prints_the_facts_creates_nothing_and_imports_no_deepspeed(tmp_path, tiny_config,
                                                                           subprocess_env):
    import torch

    from scse_dist.model import LoopedLM, flops_per_token
    from scse_dist.train.depth import sample_depth

    # data.build set and data.path missing: a real run would build it; the dry run must not
    overrides = ["train.max_steps=12", f"data.path={tmp_path / 'built' / 'shards'}",
                 f"data.tokenizer={tmp_path / 'built' / 'tokenizer.model'}",
                 "data.build=stdlib_docs", "data.build_vocab_size=320"]  # fits model.vocab_size
    config = tiny_config(tmp_path)
    code = ("import sys; from scse_dist.train.cli import main; rc = main(sys.argv[1:]); "
            "print('deepspeed imported:', 'deepspeed' in sys.modules); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "--config", config, "--dry-run", *overrides],
                         cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = load_config(config, overrides)
    torch.manual_seed(0)
    params = LoopedLM(cfg.model).num_parameters()
    depths = [sample_depth(s, cfg.train.depth, cfg.model.depth, 0) for s in range(12)]
    lines = out.stdout.splitlines()
    assert f"parameters: {params:,}" in lines
    assert f"steps: 12, tokens the run will see: {12 * 4 * 32:,}" in lines
    assert f"training depth T (uniform): min {min(depths)}, mean {sum(depths) / 12:.2f}, " \
           f"max {max(depths)}" in lines
    assert f"{flops_per_token(cfg.model, max(depths), 32):.3e} at T={max(depths)}" in out.stdout
    assert any(line.startswith("memory per rank: ") for line in lines)
    assert "not built yet; data.build=stdlib_docs builds it at the start" in out.stdout
    assert "deepspeed imported: False" in lines
    assert not (tmp_path / "runs").exists() and not (tmp_path / "built").exists()


def test_dry_run_prints_the_global_batch_derivation_at_the_world_size_asked(tmp_path, tiny_config,
                                                                          capsys, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    config = tiny_config(tmp_path, "train.batch.global_batch_tokens=2048")  # 64 sequences of 32
    derivations = {}
    for world in ("1", "4", "16"):
        assert main(["--config", config, "--dry-run", "--world-size", world]) == 0
        lines = capsys.readouterr().out.splitlines()
        derivations[world] = lines[2]
        assert f"steps: 20, tokens the run will see: {20 * 2048:,}" in lines  # at every world
    assert derivations == {"1": "global batch 64 seq (2048 tokens) = micro 4 x accum 16 x world 1",
                           "4": "global batch 64 seq (2048 tokens) = micro 4 x accum 4 x world 4",
                           "16": "global batch 64 seq (2048 tokens) = micro 4 x accum 1 x world 16"}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "32")  # the launcher's world when no --world-size is given
    assert main(["--config", config, "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "scse-train: config error: train.batch.global_batch_tokens: 2048 (64 sequences of "
        "data.seq_len 32) is not a multiple of train.batch.micro_batch_size (4) x world size (32, "
        "from WORLD_SIZE)")


@pytest.mark.parametrize("overrides, message", [
    (["train.start.resume_from=last"],
     "train.start.resume_from: expected a checkpoint tag like step-40, got 'last'"),
    (["train.start.resume_from=step-40", "train.start.resume=never"],
     "train.start.resume_from: contradicts train.start.resume=never"),
])
def test_a_bad_resume_from_is_one_line_and_exit_2(tmp_path, tiny_config, capsys, overrides,
                                                  message):
    assert main(["--config", tiny_config(tmp_path), "--print-config", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_dry_run_of_a_fixed_stack_counts_the_depth_it_runs(tmp_path, tiny_config, monkeypatch):
    """untied with untied_match=params runs one block group whatever model.depth says: the dry run
    asks the model's Transition (fixed_depth 1) instead of assuming model.depth (which made it
    fail: 'has the fixed depth 1, got 4')."""
    from scse_dist.model import flops_per_token
    from scse_dist.train.dry_run import describe

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(tiny_config(tmp_path), ["model.recurrence=untied",
                                              "model.untied_match=params", "train.max_steps=5"])
    lines = describe(cfg).splitlines()
    assert "training depth T (uniform): min 1, mean 1.00, max 1" in lines
    assert f"{flops_per_token(cfg.model, 1, cfg.data.seq_len):.3e} at T=1" in "\n".join(lines)
