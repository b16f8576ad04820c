"""Resume safety: verified checkpoints with fallback, refusal of a changed model,
train.start.resume.

Unit tests check manifests and config comparison in-process; the rest run the trainer as a real
process on copies of one tiny run (step-0000010 and step-0000020, trained once per module).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scse_dist.checkpoint import manifest
from scse_dist.checkpoint.cli import main as ckpt_main
from scse_dist.checkpoint.resume import refused_changes
from scse_dist.config import load_config
from train_procs import REPO, TRAIN, read_metrics

MODEL_FILE = "mp_rank_00_model_states.pt"


# --------------------------------------------------------------------------- manifests, in-process


def make_tag(root: Path) -> Path:
    tag = root / "step-0000010"
    (tag / "sub").mkdir(parents=True)
    (tag / "a.pt").write_bytes(b"x" * 1000)
    (tag / "sub" / "b.pt").write_bytes(b"y" * 10)
    files = manifest.tag_files(tag)
    # Two sharers hash disjoint halves; their union is the manifest.
    shares = [manifest.hash_files(tag, manifest.share_of(files, i, 2)) for i in range(2)]
    assert set(shares[0]).isdisjoint(shares[1])
    manifest.write_manifest(tag, {**shares[0], **shares[1]})
    return tag


def test_manifest_finds_missing_short_differing_and_extra_files(tmp_path):
    tag = make_tag(tmp_path)
    written = json.loads((tag / manifest.MANIFEST_NAME).read_text())
    assert sorted(written["files"]) == ["a.pt", "sub/b.pt"]
    assert written["files"]["a.pt"]["size"] == 1000
    assert str(manifest.verify_tag(tag)) == "ok"

    (tag / "a.pt").write_bytes(b"x" * 999)
    assert str(manifest.verify_tag(tag)) == "broken: a.pt is 999 bytes, manifest says 1000"
    (tag / "a.pt").write_bytes(b"x" * 999 + b"z")  # same size, other bytes
    assert str(manifest.verify_tag(tag)) == \
        "broken: a.pt differs from the manifest (xxh3_64 mismatch)"
    (tag / "a.pt").write_bytes(b"x" * 1000)
    (tag / "stray.pt").write_bytes(b"")
    assert str(manifest.verify_tag(tag)) == "broken: stray.pt is not in the manifest"
    (tag / "stray.pt").unlink()
    # the universal form a resume at another world size derives inside the tag is not the tag's
    for derived in ("universal", ".tmp-universal"):
        (tag / derived / "zero").mkdir(parents=True)
        (tag / derived / "zero" / "w.pt").write_bytes(b"u")
    assert str(manifest.verify_tag(tag)) == "ok"
    (tag / "sub" / "b.pt").unlink()
    assert str(manifest.verify_tag(tag)) == "broken: sub/b.pt is missing"
    (tag / manifest.MANIFEST_NAME).unlink()
    status = manifest.verify_tag(tag)
    assert status.intact and str(status) == "no manifest"


def test_scse_ckpt_lines_and_exit_statuses(tmp_path, capsys):
    tag = make_tag(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "latest").write_text(tag.name)
    assert ckpt_main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "step-0000010: ok  <- latest\n"
    (tag / "sub" / "b.pt").write_bytes(b"")
    assert ckpt_main(["list", str(tmp_path / "checkpoints")]) == 1
    # no scse_meta.json or config.json in this hand-made tag: step, world and stage unknown
    assert capsys.readouterr().out == (
        "step-0000010  step ?  world ?  ZeRO-?  1.1 KiB  broken: sub/b.pt is 0 bytes, manifest "
        "says 10  <- latest\n")
    assert ckpt_main(["verify", str(tmp_path / "nothing")]) == 66
    assert capsys.readouterr().err == f"scse-ckpt: error: {tmp_path / 'nothing'}: no such run dir\n"


def test_refused_changes_name_model_and_stream_fields_only(tiny_config, tmp_path):
    from scse_dist.config import config_to_dict

    saved = config_to_dict(load_config(tiny_config(tmp_path)))
    allowed = config_to_dict(load_config(tiny_config(
        tmp_path, "train.max_steps=99", "train.log_every=1", "train.checkpoint.every=3",
        "train.checkpoint.keep=5", "eval.max_batches=7", "train.max_nonfinite_steps=9",
        "train.start.resume=require", "model.activation_checkpointing=block", "data.num_workers=1",
        "data.seq_len=16")))  # the stream's positions are token counts: it resumes exactly
    assert refused_changes(saved, allowed) == []
    changed = config_to_dict(load_config(tiny_config(
        tmp_path, "model.d_model=64", "train.seed=3", "data.shuffle_buffer=8")))
    assert refused_changes(saved, changed) == [
        "data.shuffle_buffer: 0 -> 8", "model.d_model: 32 -> 64",
        "train.seed: 0 -> 3"]



def test_a_checkpoint_saved_before_a_model_field_existed_resumes(tiny_config, tmp_path):
    """A saved config that predates model fields (n_kv_heads, head_dim, qk_norm, ...) ran with
    their values of then (read_saved_config): resuming it under today's defaults changes nothing."""
    from scse_dist.config import config_to_dict, read_saved_config
    from scse_dist.model.config import VALUE_BEFORE_FIELD

    current = config_to_dict(load_config(tiny_config(tmp_path)))
    saved = config_to_dict(load_config(tiny_config(tmp_path)))
    for name in VALUE_BEFORE_FIELD:
        del saved["model"][name]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    saved = read_saved_config(tmp_path / "config.json")
    assert refused_changes(saved, current) == []
    gqa = config_to_dict(load_config(tiny_config(tmp_path, "model.n_kv_heads=1")))
    assert refused_changes(saved, gqa) == ["model.n_kv_heads: None -> 1"]

# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config, subprocess_env):
    """A finished tiny run with checkpoints step-0000010 and step-0000020 (latest)."""
    root = tmp_path_factory.mktemp("trained")
    out = train(tiny_config(root), subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "runs" / "tiny"


def train(config: str, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, "--config", config, *overrides], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def run_copy(trained, tmp_path, tiny_config):
    """(config path, run dir): a copy of the trained run that a test may break."""
    run_dir = tmp_path / "runs" / "tiny"
    shutil.copytree(trained, run_dir)
    return tiny_config(tmp_path), run_dir


def resumed_tag(stdout: str) -> tuple[str, int]:
    """(tag, step) of the trainer's `resumed <tag>/<file> at step N` line."""
    match = re.search(r"resumed \S*/checkpoints/(step-\d+)/\S+ at step (\d+) \(data stream", stdout)
    assert match, stdout[-2000:]
    return match.group(1), int(match.group(2))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_truncated_latest_is_named_and_the_run_falls_back(run_copy, subprocess_env, capsys):
    config, run_dir = run_copy
    ckpts = run_dir / "checkpoints"
    assert ckpt_main(["verify", str(run_dir)]) == 0
    broken = ckpts / "step-0000020" / MODEL_FILE
    size = broken.stat().st_size
    with open(broken, "r+b") as f:
        f.truncate(size // 2)
    capsys.readouterr()
    assert ckpt_main(["verify", str(run_dir)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "step-0000010: ok",
        f"step-0000020: broken: {MODEL_FILE} is {size // 2} bytes, manifest says {size}  <- latest"]
    assert ckpt_main(["list", str(ckpts)]) == 1
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("step-0000010  step 10  world 1  ZeRO-1  ") and \
        listed[0].endswith(" ok")

    out = train(config, subprocess_env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"checkpoint step-0000020: {MODEL_FILE} is {size // 2} bytes, manifest says {size}; "
            "falling back to step-0000010") in out.stderr
    assert resumed_tag(out.stdout) == ("step-0000010", 10)
    assert (ckpts / "latest").read_text() == "step-0000020"
    assert ckpt_main(["verify", str(run_dir)]) == 0  # the re-saved step-0000020 is whole


def test_no_intact_checkpoint_is_one_line_and_exit_65(run_copy, subprocess_env):
    config, run_dir = run_copy
    ckpts = run_dir / "checkpoints"
    (ckpts / "step-0000020" / MODEL_FILE).write_bytes(b"")
    optim = next((ckpts / "step-0000010").glob("*optim_states.pt"))
    data = bytearray(optim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optim.write_bytes(bytes(data))
    out = train(config, subprocess_env)
    assert out.returncode == 65, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"scse-train: error: {ckpts}: no intact checkpoint to resume "
                           f"(step-0000020: {MODEL_FILE} is 0 bytes, manifest says ")
    assert f"step-0000010: {optim.name} differs from the manifest" in last
    assert "Traceback" not in out.stderr


def test_changed_model_is_refused_before_anything_is_loaded(run_copy, subprocess_env):
    config, run_dir = run_copy
    before = snapshot(run_dir)
    out = train(config, subprocess_env, "model.d_model=64", "data.shuffle_buffer=4")
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (
        f"scse-train: config error: {run_dir} holds checkpoint step-0000020 of another model or "
        "data stream: data.shuffle_buffer: 0 -> 4; model.d_model: 32 -> 64. Give this run another "
        "name, or set train.start.resume=never to move the old checkpoints aside and start fresh")
    assert snapshot(run_dir) == before  # config.yaml and the checkpoints untouched


def test_allowed_change_resumes(run_copy, subprocess_env):
    config, run_dir = run_copy
    out = train(config, subprocess_env, "train.max_steps=25", "train.log_every=1",
                "eval.max_batches=1", "train.start.resume=require")
    assert out.returncode == 0, out.stderr[-3000:]
    assert resumed_tag(out.stdout) == ("step-0000020", 20)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000025"


def test_resume_never_moves_the_old_run_aside_and_require_needs_one(run_copy, tmp_path,
                                                                    subprocess_env, tiny_config):
    config, run_dir = run_copy
    old = snapshot(run_dir / "checkpoints")
    out = train(config, subprocess_env, "train.start.resume=never", "train.max_steps=2",
                "model.d_model=64")
    assert out.returncode == 0, out.stderr[-3000:]
    (aside,) = run_dir.glob("old-*")
    assert f"moved the previous run's files to {aside}; starting fresh" in out.stdout
    assert "resumed" not in out.stdout
    assert snapshot(aside / "checkpoints") == old
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "export", "metrics.jsonl"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-0000002"

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    out = train(tiny_config(fresh), subprocess_env, "train.start.resume=require")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"scse-train: config error: train.start.resume: require, but {fresh / 'runs' / 'tiny'} has "
        f"no checkpoint to resume ({fresh / 'runs' / 'tiny' / 'checkpoints' / 'latest'} does not "
        "exist)")


def test_resume_from_a_chosen_tag_moves_the_newer_ones_aside(run_copy, subprocess_env):
    config, run_dir = run_copy
    first_rows = read_metrics(run_dir)
    out = train(config, subprocess_env, "train.start.resume_from=step-10")
    assert out.returncode == 0, out.stderr[-3000:]
    assert resumed_tag(out.stdout) == ("step-0000010", 10)
    aside = next(run_dir.glob("old-*/checkpoints"))
    assert sorted(p.name for p in aside.iterdir()) == ["step-0000020"]  # moved, not deleted
    assert "moved the newer checkpoints step-0000020 to" in out.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 5, 10, 11, 15, 20]
    assert rows[-1]["loss"] == first_rows[-1]["loss"]  # the same steps 16-20 again, exactly


def test_resume_from_a_missing_tag_lists_the_available_ones_and_changes_nothing(run_copy,
                                                                                subprocess_env):
    config, run_dir = run_copy
    before = snapshot(run_dir)
    out = train(config, subprocess_env, "train.start.resume_from=step-15")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"scse-train: config error: train.start.resume_from: {run_dir} has no checkpoint step-15; "
        "available: step-0000010, step-0000020"]
    assert snapshot(run_dir) == before
