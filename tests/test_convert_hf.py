"""scse-convert: tiny random transformers models saved with save_pretrained import with
transformers' logits (fp32, 1e-4): a LlamaForCausalLM (grouped-query 4:1, untied, llama3 RoPE
scaling, which the logits need), a Qwen3ForCausalLM (q/k norm, head_dim != hidden / heads, tied)
and a tied Llama; the tokenizer comes along byte for byte. to-hf writes plain folders that
transformers loads without remote code, logits equal to the native model's. What the model cannot
compute (attention bias, a yarn RoPE scaling, a sliding window) and a looped export are refused:
one line, exit 65, nothing written; a missing folder or an unreachable hub id is exit 66.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scse_dist.checkpoint.export import load_exported_model, save_exported_model  # noqa: E402
from scse_dist.config import RunConfig  # noqa: E402
from scse_dist.convert.cli import main  # noqa: E402
from scse_dist.data.tokenizer import Tokenizer  # noqa: E402
from scse_dist.data.tokenizer_hf import train_byte_bpe  # noqa: E402
from scse_dist.model import LoopedLM, ModelConfig  # noqa: E402

# transformers imports a model's module on first use (seconds): once here, not in the first test
_CLASSES = (transformers.LlamaForCausalLM, transformers.Qwen3ForCausalLM,
            transformers.AutoTokenizer)

VOCAB = 300
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = ["the cat sat on the mat.", "a small bird follows the tall tree.", "hello world"]
    return Path(train_byte_bpe(texts * 30, VOCAB, str(out)))


def _saved(model, folder: Path, tokenizer_file: Path) -> Path:
    """model (random norms too, so a misplaced norm shows) saved with save_pretrained."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    shutil.copy(tokenizer_file, folder / "tokenizer.json")
    return folder


def llama(tmp_path: Path, tokenizer_file: Path, tied: bool = False, **extra) -> tuple:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, **extra}, num_attention_heads=8,
                                   num_key_value_heads=2, tie_word_embeddings=tied,
                                   rope_theta=5000.0, rope_scaling=dict(LLAMA3))
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, _saved(model, tmp_path / "llama", tokenizer_file)


def qwen3(tmp_path: Path, tokenizer_file: Path) -> tuple:
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=24, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    return model, _saved(model, tmp_path / "qwen3", tokenizer_file)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))


def max_diff(model, native: LoopedLM) -> float:
    with torch.no_grad():
        return (model(tokens()).logits - native(tokens()).logits).abs().max().item()


def convert(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (save_pretrained's progress bars)
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_llama_gqa_llama3_rope_imports_with_transformers_logits(tmp_path, tokenizer_file,
                                                                capsys):
    model, folder = llama(tmp_path, tokenizer_file)
    status, out, _ = convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))
    assert status == 0 and "2 layers, untied embeddings" in out
    native, cfg = load_exported_model(tmp_path / "exp")
    m = cfg.model
    assert (m.recurrence, m.n_kv_heads, m.head_dim, m.norm_eps, m.rope_theta) == \
        ("untied", 2, None, 1e-5, 5000.0)
    assert m.rope_scaling is not None and m.rope_scaling.original_max_position_embeddings == 16
    assert max_diff(model, native) <= 1e-4
    # the scaling is what makes them equal: without it the logits are another model's
    plain = LoopedLM(ModelConfig(**{**vars(m), "rope_scaling": None})).eval()
    plain.load_state_dict(native.state_dict())
    assert max_diff(model, plain) > 1e-3
    # its tokenizer came along: the same file, so the same hash in shards written with it
    assert Tokenizer.load(cfg.data.tokenizer).sha256 == Tokenizer.load(str(tokenizer_file)).sha256
    # the export's remote code carries the scaling too (transformers 5 owns a rope_scaling name)
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp",
                                                               trust_remote_code=True).eval()
    assert vars(remote.config.model_config().rope_scaling) == vars(m.rope_scaling)  # its own class
    assert max_diff(model, remote) <= 1e-4


def test_qwen3_qk_norm_and_head_dim_import_with_transformers_logits(tmp_path, tokenizer_file,
                                                                    capsys):
    model, folder = qwen3(tmp_path, tokenizer_file)
    assert convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))[0] == 0
    native, cfg = load_exported_model(tmp_path / "exp")
    assert (cfg.model.qk_norm, cfg.model.head_dim, cfg.model.tie_embeddings) == (True, 24, True)
    assert max_diff(model, native) <= 1e-4


def test_a_tied_llama_keeps_its_tie_and_its_logits(tmp_path, tokenizer_file, capsys):
    model, folder = llama(tmp_path, tokenizer_file, tied=True)
    status, out, _ = convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))
    assert status == 0 and "tied embeddings" in out
    native, cfg = load_exported_model(tmp_path / "exp")
    assert cfg.model.tie_embeddings and native.head is None
    assert max_diff(model, native) <= 1e-4


@pytest.mark.parametrize("build", [llama, qwen3])
def test_to_hf_loads_in_plain_transformers_with_native_logits(build, tmp_path, tokenizer_file,
                                                              capsys):
    _, folder = build(tmp_path, tokenizer_file)
    convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))
    status, out, _ = convert(capsys, "to-hf", str(tmp_path / "exp"), "--out", str(tmp_path / "hf"))
    arch = "LlamaForCausalLM" if build is llama else "Qwen3ForCausalLM"
    assert status == 0 and f"({arch}, 2 layers)" in out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch] and "auto_map" not in config
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == arch
    native, _ = load_exported_model(tmp_path / "exp")
    assert max_diff(back, native) <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the cat sat on the mat."
    assert tok(text)["input_ids"] == Tokenizer.load(str(tokenizer_file)).encode(text)


def test_a_trained_untied_stack_goes_out_with_its_layers_in_running_order(tmp_path, capsys,
                                                                          tokenizer_file):
    """prelude, two groups of two core blocks, coda: six Llama layers in the order they run."""
    from scse_dist.model.config import RopeScaling

    model_cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2,
                            recurrence="untied", residual="preln", n_prelude=1, n_core=2,
                            depth=2, n_coda=1, tie_embeddings=False,
                            rope_scaling=RopeScaling(original_max_position_embeddings=16))
    torch.manual_seed(3)
    native = LoopedLM(model_cfg).eval()
    with torch.no_grad():
        for p in native.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_exported_model(native.state_dict(), RunConfig(model=model_cfg), str(tmp_path / "exp"),
                        tokenizer=str(tokenizer_file))
    status, out, _ = convert(capsys, "to-hf", str(tmp_path / "exp"), "--out", str(tmp_path / "hf"))
    assert status == 0 and "(LlamaForCausalLM, 6 layers)" in out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert max_diff(back, native) <= 1e-4


def test_sharded_weights_import(tmp_path, tokenizer_file, capsys):
    model, folder = llama(tmp_path, tokenizer_file)
    shutil.rmtree(folder)
    model.save_pretrained(folder, max_shard_size="40KB")
    shutil.copy(tokenizer_file, folder / "tokenizer.json")
    assert (folder / "model.safetensors.index.json").is_file()
    assert convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))[0] == 0
    assert max_diff(model, load_exported_model(tmp_path / "exp")[0]) <= 1e-4


REFUSED = {
    "attention_bias": {"attention_bias": True},
    "rope_scaling": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 32}},
    "sliding_window": {"use_sliding_window": True, "sliding_window": 16},
    "hidden_act": {"hidden_act": "gelu"},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_what_the_model_cannot_compute_is_refused(field, tmp_path, tokenizer_file, capsys):
    _, folder = llama(tmp_path, tokenizer_file)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **REFUSED[field]}))
    status, _, err = convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))
    assert status == 65 and len(err.strip().splitlines()) == 1 and f"{field}:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_a_bias_tensor_is_refused_by_name(tmp_path, tokenizer_file, capsys):
    from safetensors.torch import load_file, save_file

    _, folder = llama(tmp_path, tokenizer_file)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    status, _, err = convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))
    assert status == 65 and "model.layers.1.self_attn.q_proj.bias" in err
    assert not (tmp_path / "exp").exists()


def test_a_looped_export_is_refused_by_to_hf(tmp_path, capsys, tokenizer_file):
    cfg = RunConfig(model=ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=2, depth=2))
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path / "exp"),
                        tokenizer=str(tokenizer_file))
    status, _, err = convert(capsys, "to-hf", str(tmp_path / "exp"), "--out", str(tmp_path / "hf"))
    assert status == 65 and len(err.strip().splitlines()) == 1
    assert "model.recurrence: scse loops" in err and not (tmp_path / "hf").exists()


def test_a_missing_folder_or_unreachable_hub_id_is_exit_66(tmp_path, capsys, monkeypatch):
    status, _, err = convert(capsys, "from-hf", str(tmp_path / "nope"), "--out",
                             str(tmp_path / "exp"))
    assert status == 66 and "no such folder" in err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, _, err = convert(capsys, "from-hf", "no-such-owner/no-such-model", "--out",
                             str(tmp_path / "exp"))
    assert status == 66 and len(err.strip().splitlines()) == 1 and "hub download failed" in err
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [dict(factor=0.5), dict(low_freq_factor=4.0, high_freq_factor=1.0),
                                 dict(original_max_position_embeddings=0)])
def test_a_rope_scaling_that_is_not_one_is_a_config_error(bad):
    from scse_dist.config import check_model
    from scse_dist.model.config import RopeScaling
    from scse_dist.typed_yaml import ConfigError

    with pytest.raises(ConfigError, match="model.rope_scaling"):
        check_model(ModelConfig(rope_scaling=RopeScaling(**bad)))
    check_model(ModelConfig(rope_scaling=RopeScaling()))  # the defaults are Llama 3.1's


@pytest.mark.parametrize("recurrence", ["scse", "additive", "looped"])
def test_an_imported_llama_retrofits_to_its_own_logits_at_depth_1(recurrence, tmp_path,
                                                                  tokenizer_file, capsys):
    """from-hf, then retrofit with a map that keeps every layer: at T = 1 the looped model is
    transformers' Llama, to fp32 rounding (GQA and llama3 RoPE carried through both steps)."""
    model, folder = llama(tmp_path, tokenizer_file, num_hidden_layers=4)
    assert convert(capsys, "from-hf", str(folder), "--out", str(tmp_path / "exp"))[0] == 0
    status, out, err = convert(capsys, "retrofit", str(tmp_path / "exp"), "--out",
                               str(tmp_path / "loop"), "--recurrence", recurrence,
                               "--prelude", "0", "--core", "1-2", "--coda", "3")
    assert (status, err) == (0, "") and "layers left out: none" in out
    looped, cfg = load_exported_model(tmp_path / "loop")
    assert (cfg.model.recurrence, cfg.model.n_kv_heads, cfg.model.n_core) == (recurrence, 2, 2)
    with torch.no_grad():
        at_1 = looped(tokens(), depth=1).logits
        assert (model(tokens()).logits - at_1).abs().max().item() <= 1e-4
        assert (looped(tokens(), depth=2).logits - at_1).abs().max().item() > 1e-3
