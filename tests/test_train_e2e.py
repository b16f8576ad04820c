"""End to end through real processes: `python launch/train.py`, resume, 2 ranks, bad config."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scse_dist.config import load_config
from scse_dist.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
METRIC_KEYS = {"step", "loss", "lr", "depth", "tokens_per_s", "mfu", "step_time_s", "tokens",
               "skipped_steps", "data_failures"}

# Loop diagnostics on log steps (log_every 5; depth 2 trained as U{1..3}: D up to t = 3)
DIAG_KEYS = {f"diag/{k}" for k in (
    "D_norm_t0", "D_norm_t1", "D_norm_t2", "D_norm_t3", "D_ratio_t0", "D_ratio_t1", "D_ratio_t2",
    "D_kept", "anchor_norm", "core_scale", "anchor_over_scale", "response_norm", "source_norm",
    "cos_D0_anchor", "cos_DT_anchor", "loss_t1", "loss_tT", "loop_gain", "grad_norm",
    "grad_share_anchor", "grad_share_core", "grad_share_prelude", "grad_share_coda",
    "grad_share_embed", "jacobian_norm", "jacobian_gain_D0", "branch_attn_b0", "branch_mlp_b0",
    *(f"update_ratio{m}_{g}" for m in ("", "_max")
      for g in ("embed", "prelude", "anchor", "core_attn", "core_mlp", "coda", "norm")))}

pytestmark = pytest.mark.slow


def run(args: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    return out


def must_pass(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config, subprocess_env):
    """One 20-step single-process run with a checkpoint every 10 steps and eval after training."""
    root = tmp_path_factory.mktemp("single")
    cfg = tiny_config(root, "eval.after_train=true")
    stdout = must_pass(run([sys.executable, TRAIN, "--config", cfg], subprocess_env))
    return {"config": cfg, "run_dir": root / "runs" / "tiny", "stdout": stdout}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_single_process_run_learns_logs_checkpoints_and_evaluates(trained):
    run_dir = trained["run_dir"]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20]
    assert set(rows[0]) == METRIC_KEYS  # step 1: a log step, not a diagnostics step
    assert all(set(r) == METRIC_KEYS | DIAG_KEYS for r in rows[1:])
    for r in rows[1:]:
        shares = sum(v for k, v in r.items() if k.startswith("diag/grad_share_"))
        assert shares == pytest.approx(1.0) and r["diag/D_norm_t0"] > 0
        assert r["diag/loop_gain"] == r["diag/loss_t1"] - r["diag/loss_tT"]
    assert "D_T/D_0" in trained["stdout"] and "R/rho" in trained["stdout"]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # 5.78 -> 4.6 measured
    assert rows[0]["lr"] == pytest.approx(3e-3 / 2)  # first warmup step: lr / warmup_steps
    assert rows[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # last step: min_lr_ratio * lr
    assert all(1 <= r["depth"] <= 3 for r in rows)  # uniform 1..3
    assert rows[-1]["tokens"] == 20 * 4 * 32
    # no MFU on CPU without SCSE_PEAK_FLOPS: tokens/s is the honest figure there
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)
    assert "mfu" not in trained["stdout"]
    assert all(r["skipped_steps"] == 0 and r["data_failures"] == 0 for r in rows)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts == ["step-0000010", "step-0000020"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-0000020"
    heldout = json.loads((run_dir / "eval" / "heldout.json").read_text())
    assert "step-0000020" in json.dumps(heldout) and '"depth": 2' in json.dumps(heldout)
    assert f"run dir {run_dir}: metrics.jsonl" in trained["stdout"]


def test_export_equals_the_final_checkpoint(trained):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from scse_dist.checkpoint.export import load_exported_model
    from scse_dist.model import LoopedLM

    run_dir = trained["run_dir"]
    exported, cfg = load_exported_model(run_dir / "export")
    assert cfg.model.d_model == 32 and cfg.train.max_steps == 20
    reference = LoopedLM(load_config(trained["config"]).model)
    state = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"),
                                                     tag="step-0000020")
    reference.load_state_dict(state, strict=False)
    fresh = LoopedLM(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = exported.eval()(tokens, depth=3).logits
        want = reference.eval()(tokens, depth=3).logits
        untrained = fresh.eval()(tokens, depth=3).logits
    assert torch.equal(got, want)
    assert (got - untrained).abs().max() > 1e-2  # the export holds trained weights


def test_resume_from_the_middle_checkpoint_reproduces_the_run_exactly(trained, tmp_path,
                                                                      subprocess_env):

    run_dir = trained["run_dir"]
    reference = load_file(str(run_dir / "export" / "model.safetensors"))
    first_losses = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    # Pretend the job died after step 10: drop the step-20 checkpoint and the export.
    shutil.rmtree(run_dir / "checkpoints" / "step-0000020")
    (run_dir / "checkpoints" / "latest").write_text("step-0000010")
    shutil.rmtree(run_dir / "export")
    stdout = must_pass(run([sys.executable, TRAIN, "--config", trained["config"],
                            "eval.after_train=false"], subprocess_env))
    assert "at step 10 (data stream and RNG restored)" in stdout
    resumed = load_file(str(run_dir / "export" / "model.safetensors"))
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key
    rows = read_metrics(run_dir)
    # the rows the first run wrote past step 10 were cut at the resume: no step twice, none
    # going backwards; steps 16-20 give the same mean loss (row 15 covers 12-15 after the
    # resume's row of step 11)
    assert [r["step"] for r in rows] == [1, 5, 10, 11, 15, 20]
    assert rows[-1]["loss"] == first_losses[20]


def test_two_ranks_with_the_deepspeed_launcher_zero2(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path, "train.engine.zero_stage=2", "train.max_steps=2",
                      "train.log_every=1",
                      "train.checkpoint.every=1",
                      f"train.engine.deepspeed_config={REPO / 'configs/deepspeed/zero2.json'}")
    out = run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), TRAIN,
               "--config", cfg], subprocess_env)
    stdout = must_pass(out)
    assert "world 2 (env), ZeRO-2" in stdout
    step2 = tmp_path / "runs" / "tiny" / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in step2.iterdir()) == [
        "config.json", "manifest.json", "mp_rank_00_model_states.pt", "scse_meta.json",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # the manifest covers every other file, hashed by both ranks (each half) and merged by rank 0
    assert sorted(json.loads((step2 / "manifest.json").read_text())["files"]) == [
        p.name for p in sorted(step2.iterdir()) if p.name != "manifest.json"]
    assert json.loads((step2 / "scse_meta.json").read_text()) == {"step": 2, "world_size": 2}
    client = torch.load(step2 / "mp_rank_00_model_states.pt", weights_only=False)
    assert client["step"] == 2 and len(client["ranks"]) == 2
    assert [r["data"]["consumed_batches"] for r in client["ranks"]] == [2, 2]
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert [r["step"] for r in rows] == [1, 2]
    # gradient shares from ZeRO-2's partitioned gradients (safe_get_full_grad on both ranks)
    assert sum(v for k, v in rows[0].items() if k.startswith("diag/grad_share_")) == \
        pytest.approx(1.0)
    # update ratios from ZeRO-2's fp32 master partitions (safe_get_full_fp32_param, both ranks)
    # against the two checkpoints' weights: step 2 moved W_1 to W_2
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from scse_dist.param_groups import group_of

    w1, w2 = (get_fp32_state_dict_from_zero_checkpoint(str(step2.parent), tag=f"step-000000{i}")
              for i in (1, 2))
    for g in ("anchor", "core_mlp", "norm", "embed"):
        names = [n for n in w1 if group_of(n) == g]
        moved = sum(float((w2[n] - w1[n]).detach().pow(2).sum()) for n in names) ** 0.5
        size = sum(float(w1[n].detach().pow(2).sum()) for n in names) ** 0.5
        assert rows[1][f"diag/update_ratio_{g}"] == pytest.approx(moved / size, rel=1e-4), g
    assert (tmp_path / "runs" / "tiny" / "export" / "model.safetensors").is_file()


def test_zero3_with_the_loop_leaf_trains(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path, "train.engine.zero_stage=3", "train.max_steps=2",
                      "train.log_every=1")
    stdout = must_pass(run([sys.executable, TRAIN, "--config", cfg], subprocess_env))
    export = load_file(str(tmp_path / "runs" / "tiny" / "export" / "model.safetensors"))
    # counted before ZeRO-3 partitions the parameters (it printed 0 parameters once)
    assert f"training tiny: {sum(t.numel() for t in export.values()):,} parameters" in stdout
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert not any(k.startswith("diag/") for r in rows for k in r)  # skipped at ZeRO-3


def test_bad_config_exits_2_naming_the_field_before_any_process_group(tmp_path, tiny_config,
                                                                      subprocess_env):
    cfg = tiny_config(tmp_path)
    # Claim to be rank 0 of 2: had the trainer started a process group it would wait for rank 1.
    env = dict(subprocess_env, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), SCSE_DIST_TIMEOUT_S="60")
    out = run([sys.executable, TRAIN, "--config", cfg, "model.n_layerz=3"], env, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_layerz: unknown field" in lines[0]
    assert lines[0].endswith("(on the command line: model.n_layerz=3)")  # not the file's mistake
    assert out.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_a_corrupt_sample_is_skipped_and_counted_in_the_metrics(tmp_path, tiny_data, tiny_config,
                                                                subprocess_env):
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data["path"], shards)
    tar = shards / json.loads((shards / "index.json").read_text())["splits"]["train"][0]["url"]
    data = bytearray(tar.read_bytes())
    arrays = [i for i in range(len(data)) if data.startswith(b"\x93NUMPY", i)]
    for at in arrays[:-2:2]:  # every sample's tokens.npy but the last's: np.load fails on them
        data[at:at + 6] = b"garbag"
    tar.write_bytes(bytes(data))
    cfg = tiny_config(tmp_path, f"data.path={shards}", "train.max_steps=10", "train.log_every=5")
    out = run([sys.executable, TRAIN, "--config", cfg], subprocess_env)
    must_pass(out)
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert [r["step"] for r in rows] == [1, 5, 10]
    assert rows[-1]["data_failures"] >= 1 and all(r["skipped_steps"] == 0 for r in rows)
    # one line per bad sample as it is met, naming it, and their total at the end: no warnings
    skipped = [line for line in out.stderr.splitlines() if line.startswith("skipping ")]
    assert skipped and all(f"{tar}: sample " in line for line in skipped), out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == (f"scse-train: rank 0: {len(skipped)} bad "
                                           "shards/samples skipped in all (data.max_failures=100)")


def test_a_rerun_with_fewer_steps_than_its_checkpoint_is_refused_and_saves_nothing(trained,
                                                                                  subprocess_env):
    # The README's old "one process" example (quickstart.yaml ... train.max_steps=50, same run
    # name) did this after the 300-step quickstart: it saved the step-300 weights as step-50.
    ckpts = trained["run_dir"] / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir()), (ckpts / "latest").read_text()
    out = run([sys.executable, TRAIN, "--config", trained["config"], "train.max_steps=5",
               "eval.after_train=false"], subprocess_env)
    assert out.returncode == 2  # a config error, one line
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"scse-train: config error: train.max_steps: {trained['run_dir']} resumed at step ")
    assert "past train.max_steps=5: raise train.max_steps to continue that run" in out.stderr
    assert (sorted(p.name for p in ckpts.iterdir()), (ckpts / "latest").read_text()) == before


def test_diagnostics_off_the_log_steps_get_rows_of_their_own(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path, "train.max_steps=6", "train.diagnostics_every=3",
                      "train.checkpoint.every=6")
    stdout = must_pass(run([sys.executable, TRAIN, "--config", cfg], subprocess_env))
    rows = read_metrics(tmp_path / "runs" / "tiny")
    assert [(r["step"], "loss" in r, "diag/D_kept" in r) for r in rows] == [
        (1, True, False), (3, False, True), (5, True, False), (6, True, True)]
    assert set(rows[1]) == {"step"} | DIAG_KEYS
    assert "step      3 | D_T/D_0 " in stdout
