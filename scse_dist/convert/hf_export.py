"""`scse-convert to-hf`: an export of an untied model as a plain Hugging Face folder that
transformers loads without remote code: `LlamaForCausalLM`, or `Qwen3ForCausalLM` when
model.qk_norm is on (Llama has no q/k norm). config.json, model.safetensors (fp32) and, for an
"hf" tokenizer, tokenizer.json with a tokenizer_config.json. A looped model is refused: it keeps
the remote-code export (scse-export). Writes without transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scse_dist.cli_errors import InputError
from scse_dist.convert.hf_import import HF_CONFIG, HF_TOKENIZER, LAYER_NAMES, QKV

if TYPE_CHECKING:
    import torch

    from scse_dist.model import LoopedLM
    from scse_dist.model.config import ModelConfig

HF_WEIGHTS = "model.safetensors"


def _check_plain(m: ModelConfig, export: str) -> None:
    """Refuse what a plain Llama/Qwen3 layer stack does not compute (one line naming the field)."""
    why = None
    if m.recurrence != "untied":
        why = (f"model.recurrence: {m.recurrence} loops, which Llama cannot express; scse-export "
               "writes its remote-code export")
    elif m.residual != "preln":
        why = f"model.residual: {m.residual} is Post-LN; Llama's layers are pre-norm (preln)"
    elif m.init_state != "source":
        why = f"model.init_state: {m.init_state}; Llama's layers start from the embedding"
    if why:
        raise InputError(f"{export}: {why}; nothing written")


def _hf_config(m: ModelConfig, n_layers: int, special: dict[str, Any]) -> dict[str, Any]:
    qwen = m.qk_norm
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": m.rope_theta,
                **{k: getattr(m.rope_scaling, k) for k in ("factor", "low_freq_factor",
                                                           "high_freq_factor",
                                                           "original_max_position_embeddings")}}
    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen else "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "intermediate_size": m.resolved_ffn_hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.resolved_n_kv_heads,
        "head_dim": m.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "use_cache": True, "dtype": "float32",
        # transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling
        "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": None if m.rope_scaling is None else dict(rope),
    }
    if qwen:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=n_layers)
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    if special:
        config.update(bos_token_id=special["bos"], eos_token_id=special["eos"])
    return config


def hf_state_dict(model: LoopedLM) -> tuple[dict[str, torch.Tensor], int]:
    """LoopedLM's weights under transformers' names (fp32, contiguous), and the layer count:
    the prelude, the core's blocks in the order the untied stack runs them, the coda."""
    blocks = [*model.prelude, *model.core.blocks, *model.coda]
    out = {"model.embed_tokens.weight": model.embed.weight,
           "model.norm.weight": model.norm.weight}
    if model.head is not None:
        out["lm_head.weight"] = model.head.weight
    for i, block in enumerate(blocks):
        own = dict(block.named_parameters())
        for hf_name, w in zip(QKV, own.pop("attn.qkv.weight").split(block.attn.widths)):
            out[f"model.layers.{i}.{hf_name}.weight"] = w
        for hf_name, name in LAYER_NAMES.items():
            if f"{name}.weight" in own:
                out[f"model.layers.{i}.{hf_name}.weight"] = own.pop(f"{name}.weight")
        assert not own, f"unmapped block parameters {sorted(own)}"
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}, len(blocks)


def export_hf(export: str, out: str) -> str:
    """Write the plain transformers folder `out` from the export `export` (atomic.output_dir:
    nothing is written unless everything succeeded). Returns the line that says what it wrote."""
    from safetensors.torch import save_file

    from scse_dist.atomic import atomic_write, output_dir
    from scse_dist.checkpoint.export import load_export_config as read_config, load_exported_model
    from scse_dist.data.tokenizer import Tokenizer
    from scse_dist.data.tokenizer_hf import HFTokenizer

    _check_plain(read_config(export).model, export)  # before the weights are read
    model, cfg = load_exported_model(export)
    tokenizer = Tokenizer.load(cfg.data.tokenizer, cfg.data.tokenizer_kind) \
        if Path(cfg.data.tokenizer).is_file() else None
    special = tokenizer.special_ids() if tokenizer is not None else {}
    state, n_layers = hf_state_dict(model)
    config = _hf_config(cfg.model, n_layers, special)

    def made_here(url: str) -> bool:  # a folder this command wrote is replaced; others refused
        return (Path(url) / HF_WEIGHTS).is_file() and (Path(url) / HF_CONFIG).is_file()

    with output_dir(str(out), made_here, HF_WEIGHTS) as tmp:
        folder = Path(tmp)
        atomic_write(folder / HF_WEIGHTS,
                     lambda p: save_file(state, str(p), metadata={"format": "pt"}))
        atomic_write(folder / HF_CONFIG,
                     lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
        if isinstance(tokenizer, HFTokenizer):
            data = Path(cfg.data.tokenizer).read_bytes()
            atomic_write(folder / HF_TOKENIZER, lambda p: p.write_bytes(data))
            tok_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                          "eos_token": special["eos_token"],
                          "bos_token": tokenizer.tok.id_to_token(special["bos"]),
                          "clean_up_tokenization_spaces": False,
                          "model_max_length": cfg.model.max_seq_len}
            atomic_write(folder / "tokenizer_config.json",
                         lambda p: p.write_text(json.dumps(tok_config, indent=2) + "\n"))
    arch = config["architectures"][0]
    kind = tokenizer.kind if tokenizer is not None else "no"
    note = "" if kind == "hf" else \
        f"; its {kind} tokenizer is not written (only an hf tokenizer.json goes along)"
    return f"scse-convert: {export} -> {out} ({arch}, {n_layers} layers{note})"
