"""A self-contained export: it carries its tokenizer, works copied anywhere or from an fsspec URL,
and `scse-export` makes the same files from a DeepSpeed checkpoint as the trainer does."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import REPO_ROOT, TINY_VOCAB, console_script
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.checkpoint.export_cli import main as export_main
from scse_dist.checkpoint.loading import load_model
from scse_dist.config import config_from_dict
from scse_dist.eval.cli import main as eval_main
from scse_dist.hf import hf_file_names
from scse_dist.model import LoopedLM

EXPORT_FILES = sorted(["config.yaml", "model.safetensors", "tokenizer.model",
                       *hf_file_names(with_tokenizer=True)])
LAMBADA = ["the cat sees the red ball today . the dog likes the red ball",
           "my sister paints the blue river . the robot builds a quiet house"]


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_data):
    """A tiny export whose run named its tokenizer by a path relative to the training checkout."""
    root = tmp_path_factory.mktemp("portable")
    cfg = config_from_dict({"name": "tiny",
                            "data": {"seq_len": 16, "tokenizer": "data/quickstart/tokenizer.model"},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 32, "depth": 2}})
    torch.manual_seed(0)
    out = save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(root / "export"),
                              tokenizer=tiny_data["tokenizer"])
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    return Path(out), root


def _lambada(checkpoint: str, data: Path, out: Path) -> list[dict]:
    assert eval_main(["--checkpoint", checkpoint, "--task", "lambada", "--data", str(data),
                      "--depths", "1,3", "--out", str(out)]) == 0
    return json.loads(out.read_text())["results"]


def test_export_holds_its_tokenizer(export, tiny_data):
    path, _ = export
    assert sorted(p.name for p in path.iterdir()) == EXPORT_FILES
    assert (path / "tokenizer.model").read_bytes() == Path(tiny_data["tokenizer"]).read_bytes()
    assert yaml.safe_load((path / "config.yaml").read_text())["data"]["tokenizer"] == \
        "tokenizer.model"
    _, cfg = load_exported_model(path)  # the bare name resolves against the export's own dir
    assert cfg.data.tokenizer == str(path / "tokenizer.model")


def test_copied_export_evaluates_from_another_directory(export, tmp_path, user_env):
    # the reproduction: copy the export, run scse-eval elsewhere without --tokenizer
    path, root = export
    copy = tmp_path / "elsewhere" / "my-model"
    shutil.copytree(path, copy)
    cwd = tmp_path / "somewhere-else"
    cwd.mkdir()
    out = subprocess.run(["scse-eval", "--checkpoint", str(copy), "--task", "lambada",
                          "--data", str(root / "lambada.jsonl"), "--depths", "1,3",
                          "--out", "copy.json"], cwd=cwd, env=user_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    copied = json.loads((cwd / "copy.json").read_text())["results"]
    original = _lambada(str(path), root / "lambada.jsonl", tmp_path / "original.json")
    assert copied == original and [r["depth"] for r in copied] == [1, 3]



@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_export_at_an_fsspec_url_evaluates(export, tmp_path, scheme):
    path, root = export
    if scheme == "memory":
        fs = fsspec.filesystem("memory")
        for name in EXPORT_FILES:
            fs.pipe_file(f"/exports/tiny/{name}", (path / name).read_bytes())
        url = "memory://exports/tiny"
    else:
        url = path.as_uri()
    from_url = _lambada(url, root / "lambada.jsonl", tmp_path / "url.json")
    assert from_url == _lambada(str(path), root / "lambada.jsonl", tmp_path / "local.json")
    assert json.loads((tmp_path / "url.json").read_text())["checkpoint"] == url


def test_missing_file_at_a_url_is_named(export, capsys, tmp_path):
    path, root = export
    fsspec.filesystem("memory").pipe_file("/half/config.yaml", (path / "config.yaml").read_bytes())
    assert eval_main(["--checkpoint", "memory://half", "--task", "lambada", "--data",
                      str(root / "lambada.jsonl"), "--out", str(tmp_path / "x.json")]) == 66
    assert "memory://half/model.safetensors is missing" in capsys.readouterr().err
    assert eval_main(["--checkpoint", "nosuchprotocol://x/export", "--task", "lambada", "--data",
                      str(root / "lambada.jsonl"), "--out", str(tmp_path / "x.json")]) == 66
    assert "export nosuchprotocol://x/export cannot be read: ValueError" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config, subprocess_env):
    """A 2-step run (checkpoint at step 2, ZeRO-1) and its trainer export."""
    root = tmp_path_factory.mktemp("trained")
    cfg = tiny_config(root, "train.max_steps=2", "train.checkpoint.every=2")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "launch/train.py"), "--config", cfg],
                         capture_output=True, text=True, env=subprocess_env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "runs" / "tiny"


@pytest.mark.slow
def test_deepspeed_checkpoint_dir_loads_the_same_weights_as_the_export(trained, tmp_path):
    exported, _ = load_exported_model(trained / "export")
    for path in (trained, trained / "checkpoints", trained / "checkpoints" / "step-0000002"):
        model, loaded_cfg = load_model(path)
        assert loaded_cfg.name == "tiny"
        for (k, a), b in zip(exported.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), k
    with pytest.raises(FileNotFoundError, match="neither an export"):
        load_model(tmp_path)


@pytest.mark.parametrize("where", ["run", "tag"])
def test_scse_export_makes_the_trainers_files(trained, tiny_data, tmp_path, capsys, where):
    source = trained if where == "run" else trained / "checkpoints" / "step-0000002"
    assert export_main([str(source), "--out", str(tmp_path / "out")]) == 0
    assert f"-> {tmp_path / 'out'}" in capsys.readouterr().out
    ours, theirs = tmp_path / "out", trained / "export"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir()) \
        == EXPORT_FILES
    for name in ("config.yaml", "tokenizer.model", "config.json", "modeling_scse.py"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the run's own config keeps the tokenizer path it trained with
    run_cfg = yaml.safe_load((trained / "config.yaml").read_text())
    assert run_cfg["data"]["tokenizer"] == tiny_data["tokenizer"]


def test_scse_export_errors_are_one_line(trained, tmp_path, capsys):
    assert export_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 66
    assert "is neither an export" in capsys.readouterr().err
    missing = tmp_path / "missing.model"
    assert export_main([str(trained), "--out", str(tmp_path / "out"), "--tokenizer",
                        str(missing)]) == 66
    assert capsys.readouterr().err == (f"scse-export: error: tokenizer model {str(missing)!r} does "
                                       "not exist (train one with `scse-data tokenizer`)\n")
    assert not (tmp_path / "out").exists()  # nothing written before the tokenizer was read


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_scse_export_of_a_checkpoint_is_quiet_unless_verbose(trained, tmp_path, user_env, verbose):
    # DeepSpeed's accelerator warning, zero_to_fp32's lines and its progress bar: shown with -v
    env = {k: v for k, v in user_env.items() if k not in ("DS_ACCELERATOR", "SCSE_VERBOSE")}
    out = tmp_path / "out"
    proc = subprocess.run([*console_script("scse-export"), str(trained), "--out", str(out),
                           *(["-v"] if verbose else [])],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    done = f"scse-export: {trained / 'checkpoints' / 'step-0000002'} -> {out}\n"
    if not verbose:
        assert (proc.stdout, proc.stderr) == (done, "")
        return
    assert f"Processing zero checkpoint '{trained / 'checkpoints'}" in proc.stdout
    assert proc.stdout.endswith(done) and "Loading checkpoint shards" in proc.stderr
    if not torch.cuda.is_available():
        assert "Setting accelerator to CPU" in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_a_bf16_checkpoint_exports_and_evaluates(tmp_path, tiny_config, subprocess_env, stage):
    """bf16 checkpoints (DeepSpeed's bf16 wrapper at ZeRO-0 keeps fp32 masters inside the model
    states; ZeRO-1 writes bf16_zero_*_optim_states.pt): scse-export of the tag gives the trainer's
    export, and scse-eval reads the tag. At ZeRO-0 both are the module's bf16 weights widened."""
    cfg = tiny_config(tmp_path, "train.max_steps=2", "train.checkpoint.every=2",
                      "train.engine.precision=bf16", f"train.engine.zero_stage={stage}")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "launch/train.py"), "--config", cfg],
                         capture_output=True, text=True, env=subprocess_env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    tag = run / "checkpoints" / "step-0000002"
    optim = sorted(p.name for p in tag.glob("*optim_states.pt"))
    assert optim == ([] if stage == 0 else ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    assert export_main([str(tag), "--out", str(tmp_path / "out")]) == 0
    a = load_file(str(tmp_path / "out" / "model.safetensors"))
    b = load_file(str(run / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())
    if stage == 0:  # bf16 values, stored widened
        assert all(torch.equal(v, v.bfloat16().float()) for v in a.values())
    assert eval_main(["--checkpoint", str(tag), "--task", "heldout", "--depths", "1,2",
                      "--max-batches", "2", "--out", str(tmp_path / "eval.json")]) == 0
    rows = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert [r["depth"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows)
