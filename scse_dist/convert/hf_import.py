"""`scse-convert from-hf`: a Hugging Face `LlamaForCausalLM` or `Qwen3ForCausalLM` folder (what
`save_pretrained` writes: config.json, safetensors weights, tokenizer.json) as an export of an
untied model (model.recurrence untied, one stack of its layers as the core, depth 1).

The blocks already compute Llama's layer (pre-norm RMSNorm, RoPE pairing dims i and i + d/2 as
transformers' rotate_half does, SwiGLU; Qwen3's q/k norm is model.qk_norm), so the weights map one
to one: q, k and v stack into `qkv`'s rows, no permutation. What the model cannot compute exactly
(biases, RoPE scalings other than llama3, sliding windows, other activations) is refused with an
InputError naming the field before anything is written. Reads the weights without transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from scse_dist.cli_errors import InputError
from scse_dist.model.config import ModelConfig, RopeScaling

if TYPE_CHECKING:
    import torch

# model_type -> the architecture transformers saves it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"
# transformers' per-layer names -> a Block's (q, k, v are stacked into attn.qkv)
LAYER_NAMES = {"self_attn.o_proj": "attn.proj", "self_attn.q_norm": "attn.q_norm",
               "self_attn.k_norm": "attn.k_norm", "mlp.gate_proj": "mlp.gate",
               "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
               "input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def resolve_source(source: str) -> Path:
    """A local folder as is; otherwise a hub id (owner/name) downloaded by huggingface_hub
    (an OSError, exit 66, when it is not there or the network is not)."""
    path = Path(source)
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        if not path.is_dir():
            raise FileNotFoundError(f"{source}: no such folder (a save_pretrained folder, or a "
                                    "hub id owner/name)")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, no huggingface_hub: all one line
        raise OSError(f"{source}: not a local folder, and the hub download failed "
                      f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None


def _refuse(where: Path, field: str, why: str) -> InputError:
    return InputError(f"{where}: {field}: {why}; the model cannot compute it exactly, nothing "
                      "written")


def _rope(hf: dict[str, Any], where: Path) -> tuple[float, Optional[RopeScaling]]:
    """rope_theta and the llama3 scaling, from transformers 5's rope_parameters or the older
    rope_theta + rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or ("rope_type" not in params and "type" not in params
                                        and any(isinstance(v, dict) for v in params.values())):
        raise _refuse(where, "rope_parameters", "RoPE set per layer type")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(where, "partial_rotary_factor", f"{partial} (RoPE on part of each head)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _refuse(where, "rope_scaling", f"type {kind!r} (only llama3's is supported)")
    return theta, RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                        hf["max_position_embeddings"])))


def model_config_of(hf: dict[str, Any], where: Path) -> ModelConfig:
    """The ModelConfig computing what transformers computes for config.json `hf`."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise _refuse(where, "model_type", f"{kind!r} (supported: {', '.join(ARCHITECTURES)})")
    archs = hf.get("architectures") or [ARCHITECTURES[kind]]
    if archs != [ARCHITECTURES[kind]]:
        raise _refuse(where, "architectures", f"{archs} (supported: {ARCHITECTURES[kind]})")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", f"{hf['hidden_act']!r} (the MLP is SwiGLU: silu)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _refuse(where, field, "true (the model's projections have no biases)")
    if hf.get("use_sliding_window") or hf.get("sliding_window") is not None:
        raise _refuse(where, "sliding_window", f"{hf.get('sliding_window')} (attention is "
                      "causal over the whole sequence)")
    others = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if others:
        raise _refuse(where, "layer_types", f"{others} (only full_attention)")
    theta, scaling = _rope(hf, where)
    d, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or d // heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=d, n_heads=heads,
        n_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if head_dim * heads == d else head_dim,
        ffn_hidden=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        n_prelude=0, n_core=layers, n_coda=0, recurrence="untied", residual="preln", depth=1,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=kind == "qwen3",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors (nor its index); only "
                                "safetensors weights are read")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(folder / name)))
        except (SafetensorError, OSError) as exc:
            raise InputError(f"{folder / name}: not a readable safetensors file: {exc}") from None
    return state


def state_dict_of(weights: dict[str, torch.Tensor], cfg: ModelConfig, folder: Path
                  ) -> dict[str, torch.Tensor]:
    """transformers' tensors under LoopedLM's names (fp32). A tensor left unmapped (a bias, a
    layer past num_hidden_layers) is refused by name; a missing one too."""
    import torch

    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise InputError(f"{folder}: the weights lack {name!r}; nothing written")
        return weights.pop(name).float()

    out["embed.weight"] = take("model.embed_tokens.weight")
    for i in range(cfg.n_core):
        src = f"model.layers.{i}."
        out[f"core.blocks.{i}.attn.qkv.weight"] = torch.cat([take(src + n + ".weight")
                                                            for n in QKV])
        for hf_name, name in LAYER_NAMES.items():
            if "_norm" in hf_name and not hf_name.endswith("layernorm") and not cfg.qk_norm:
                continue
            out[f"core.blocks.{i}.{name}.weight"] = take(src + hf_name + ".weight")
    out["norm.weight"] = take("model.norm.weight")
    head = weights.pop("lm_head.weight", None)
    if cfg.tie_embeddings:
        if head is not None and not torch.equal(head.float(), out["embed.weight"]):
            raise _refuse(folder / HF_CONFIG, "tie_word_embeddings",
                          "true, but lm_head.weight differs from the embedding")
    elif head is None:
        raise _refuse(folder / HF_CONFIG, "tie_word_embeddings",
                      "false, but the weights hold no lm_head.weight")
    else:
        out["head.weight"] = head.float()
    if weights:
        left = sorted(weights)
        more = f" (+{len(left) - 1} more)" if len(left) > 1 else ""
        raise InputError(f"{folder}: {left[0]}{more}: a tensor the model has no place for; "
                         "nothing written")
    return out


def import_hf(source: str, out: str) -> tuple[str, ModelConfig]:
    """Read, check and convert `source`, then write the export `out` (scse_dist.atomic's
    output_dir: nothing is written unless everything succeeded). Returns (out, its model)."""
    import torch

    from scse_dist.checkpoint.export import describe_mismatch, save_exported_model, weights_mismatch
    from scse_dist.config import RunConfig
    from scse_dist.data.tokenizer_hf import HFTokenizer
    from scse_dist.model import LoopedLM

    folder = resolve_source(source)
    config_path = folder / HF_CONFIG
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{config_path}: not JSON: {exc}") from None
    cfg = model_config_of(hf, config_path)
    tok_path = folder / HF_TOKENIZER
    tokenizer = HFTokenizer(tok_path.read_bytes(), str(tok_path))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise InputError(f"{tok_path}: {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocab_size {cfg.vocab_size}; nothing written")
    state = state_dict_of(read_weights(folder), cfg, folder)
    with torch.device("meta"):  # shapes only: the weights fit before anything is written
        expected = LoopedLM(cfg).state_dict()
    problems = weights_mismatch(expected, state)
    if problems:
        raise InputError(f"{folder}: the weights do not fit {config_path}; "
                         f"{describe_mismatch(problems)}; nothing written")
    run = RunConfig(name=folder.name or "imported", model=cfg)
    run = dataclasses.replace(run, data=dataclasses.replace(
        run.data, seq_len=min(run.data.seq_len, cfg.max_seq_len)))
    return save_exported_model(state, run, out, tokenizer=tokenizer), cfg
