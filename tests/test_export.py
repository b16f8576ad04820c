"""Exported model I/O: safetensors + config.yaml round trip, ties kept, clear errors."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from conftest import tiny_cfg
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.hf import hf_file_names
from scse_dist.model import LoopedLM


def shared_groups_of(state: dict) -> list[list[str]]:
    """Names of state_dict entries that are the same memory (ties), as sorted groups."""
    by_ptr: dict[int, list[str]] = {}
    for name, t in state.items():
        by_ptr.setdefault(t.data_ptr(), []).append(name)
    return sorted(sorted(g) for g in by_ptr.values() if len(g) > 1)


@pytest.mark.parametrize("recurrence, residual", [("scse", "deeploop"), ("additive", "preln"),
                                                  ("untied", "preln")])
def test_round_trip_gives_identical_logits(tmp_path, recurrence, residual):
    cfg = tiny_cfg(recurrence=recurrence, residual=residual)
    model = LoopedLM(cfg.model).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens).logits
    out = save_exported_model(model.state_dict(), cfg, str(tmp_path / "export"))
    assert sorted(p.name for p in Path(out).iterdir()) == sorted(
        ["config.yaml", "model.safetensors", *hf_file_names(with_tokenizer=False)])

    loaded, loaded_cfg = load_exported_model(out)
    assert loaded_cfg == cfg
    assert not loaded.training
    with torch.no_grad():
        after = loaded(tokens).logits
    assert torch.equal(before, after)


def test_tied_embedding_preserved(tmp_path):
    # LoopedLM ties by reading out through embed.weight: there is no head to save or re-tie.
    cfg = tiny_cfg(tie_embeddings=True)
    model = LoopedLM(cfg.model)
    save_exported_model(model.state_dict(), cfg, str(tmp_path))
    loaded, _ = load_exported_model(tmp_path / "model.safetensors")  # the file path works too
    assert loaded.head is None
    assert loaded.num_parameters() == model.num_parameters()
    with torch.no_grad():  # the read-out really goes through the (loaded) embedding
        loaded.embed.weight[5].zero_()
        h = torch.ones(1, 1, 32)
        assert torch.equal(loaded.readout(h)[0, 0, 5], torch.tensor(0.0))


def test_shared_tensors_saved_once_and_retied(tmp_path):
    # A state dict whose head is the embedding's memory (a module tying by assignment):
    # safetensors refuses shared tensors, so one copy is stored and the alias restored on load.
    cfg = tiny_cfg(tie_embeddings=False)
    model = LoopedLM(cfg.model)
    state = model.state_dict()
    state["head.weight"] = state["embed.weight"]
    assert shared_groups_of(state) == [["embed.weight", "head.weight"]]
    save_exported_model(state, cfg, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        assert json.loads(f.metadata()["scse_tied_aliases"]) == {"head.weight": "embed.weight"}
    assert stored == set(state) - {"head.weight"}
    loaded, _ = load_exported_model(tmp_path)
    assert torch.equal(loaded.head.weight, model.embed.weight)
    assert torch.equal(loaded.embed.weight, model.embed.weight)


def test_weights_are_stored_fp32_and_wrapper_prefix_is_stripped(tmp_path):
    cfg = tiny_cfg()
    model = LoopedLM(cfg.model)
    # what a DeepSpeed engine hands over: "module."-prefixed names, here in bf16
    wrapped = {f"module.{k}": v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_exported_model(wrapped, cfg, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        assert not any(k.startswith("module.") for k in f.keys())
    assert dtypes == {torch.float32}
    loaded, _ = load_exported_model(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name].to(torch.bfloat16).float()), name


@pytest.mark.parametrize("missing", ["model.safetensors", "config.yaml"])
def test_missing_file_is_named(tmp_path, missing):
    cfg = tiny_cfg()
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path))
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_exported_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_exported_model(tmp_path / "nowhere")


def test_tampered_config_mismatch_names_the_files(tmp_path):
    cfg = tiny_cfg()
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path))
    values = yaml.safe_load((tmp_path / "config.yaml").read_text())
    values["model"]["d_model"] = 64
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    with pytest.raises(ValueError) as err:
        load_exported_model(tmp_path)
    message = str(err.value)
    assert "config.yaml" in message and "model.safetensors" in message
    assert "shape mismatch" in message and "32" in message and "64" in message


def test_garbage_weights_file_is_a_clear_error(tmp_path):
    cfg = tiny_cfg()
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors.*not a readable safetensors export"):
        load_exported_model(tmp_path)


def test_save_replaces_atomically_and_leaves_no_temp_files(tmp_path):
    cfg = tiny_cfg()
    first = LoopedLM(cfg.model)
    save_exported_model(first.state_dict(), cfg, str(tmp_path))
    torch.manual_seed(1)
    second = LoopedLM(cfg.model)
    save_exported_model(second.state_dict(), cfg, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.yaml", "model.safetensors", *hf_file_names(with_tokenizer=False)])
    loaded, _ = load_exported_model(tmp_path)
    name, value = next(iter(second.state_dict().items()))
    assert torch.equal(loaded.state_dict()[name], value)
    assert not torch.equal(value, first.state_dict()[name])


def test_views_of_one_buffer_are_stored_as_copies(tmp_path):
    # slices of one fused buffer are not ties (different shapes) but still share storage
    from safetensors.torch import load_file

    buf = torch.randn(10, 4)
    save_exported_model({"a": buf[:5], "b": buf[5:], "fused": buf}, tiny_cfg(), str(tmp_path))
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(stored["a"], buf[:5]) and torch.equal(stored["b"], buf[5:])
    assert torch.equal(stored["fused"], buf)


def test_a_path_that_is_not_an_export_says_what_it_is(tmp_path):
    from scse_dist.checkpoint.export import load_export_config
    from scse_dist.train.warm_start import check_init_from

    (tmp_path / "notes").mkdir()
    (tmp_path / "file.txt").write_text("x")
    no_weights = f"'{tmp_path}/notes' is a directory but not an export: it has no model.safetensors"
    for load, prefix in ((load_export_config, ""), (check_init_from, "train.start.init_from: ")):
        for path, reason in [(tmp_path / "notes", no_weights),
                             (tmp_path / "file.txt",
                              f"'{tmp_path}/file.txt' is a file, not an export"),
                             (tmp_path / "gone", f"'{tmp_path}/gone' does not exist")]:
            with pytest.raises(FileNotFoundError) as err:
                load(str(path))
            assert str(err.value).startswith(prefix) and reason in str(err.value), err.value


def test_the_same_weights_give_the_same_bytes_in_every_process(tmp_path):
    """safetensors writes its metadata keys in hash-map order, which varies between processes;
    the export sorts them, so a run's export hashes the same however often it is written."""
    import hashlib
    import subprocess
    import sys

    cfg = tiny_cfg()
    torch.save(LoopedLM(cfg.model).state_dict(), tmp_path / "state.pt")
    script = ("import sys, torch; from conftest import tiny_cfg; "
              "from scse_dist.checkpoint.export import save_exported_model; "
              "save_exported_model(torch.load(sys.argv[1]), tiny_cfg(), sys.argv[2])")
    digests = set()
    for i in range(6):  # two orders occur about equally often: 6 processes all alike by luck ~3%
        subprocess.run([sys.executable, "-c", script, str(tmp_path / "state.pt"),
                        str(tmp_path / f"e{i}")], check=True, cwd=Path(__file__).parent)
        digests.add(hashlib.sha256((tmp_path / f"e{i}" / "model.safetensors").read_bytes())
                    .hexdigest())
    assert len(digests) == 1
    raw = (tmp_path / "e0" / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    # the file's own order (safe_open's metadata() is a hash map again, in any order)
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) == \
        ["format", "scse_tied_aliases"]
