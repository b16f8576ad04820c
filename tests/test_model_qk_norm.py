"""model.qk_norm: RMSNorm of each head's queries and keys before RoPE; off by default and for
configs saved before the field; the KV-cache decode path equals the full forward with it on.
(The Hugging Face export's logits with it on: tests/test_hf_export.py.)"""

from __future__ import annotations

import pytest
import torch
import yaml

from scse_dist.config import config_to_dict, load_config, load_saved_config
from scse_dist.model import Block, LoopedLM
from scse_dist.model.blocks import CausalSelfAttention, apply_rope, rope_tables
from scse_dist.model.config import VALUE_BEFORE_FIELD, ModelConfig
from scse_dist.model.kv_cache import KVCache


def cfg_of(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=64,
                n_prelude=1, n_core=2, n_coda=1, depth=3)
    return ModelConfig(**{**base, **kw})


def with_random_gains(model: torch.nn.Module) -> torch.nn.Module:
    """q/k gains away from their init of ones, so a path that skipped one would show."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    return model


def test_off_by_default_and_no_parameters_then():
    assert ModelConfig().qk_norm is False and VALUE_BEFORE_FIELD["qk_norm"] is False
    plain = LoopedLM(cfg_of())
    normed = LoopedLM(cfg_of(qk_norm=True))
    extra = set(normed.state_dict()) - set(plain.state_dict())
    # one (head_dim,) gain each for q and k in every attention: 1 prelude + 2 core + 1 coda
    assert sorted(extra) == sorted(f"{where}.attn.{n}_norm.weight" for n in "qk"
                                   for where in ("prelude.0", "core.blocks.0", "core.blocks.1",
                                                 "coda.0"))
    assert all(normed.state_dict()[k].shape == (16,) for k in extra)
    assert set(plain.state_dict()) <= set(normed.state_dict())


def test_queries_and_keys_are_normalised_per_head_before_rope():
    torch.manual_seed(0)
    cfg = cfg_of(qk_norm=True)
    attn = with_random_gains(CausalSelfAttention(cfg))
    x = torch.randn(2, 9, 32)
    rope = rope_tables(9, cfg, x.device)
    # what attention computes, by hand: per head RMS-normalised q and k times the gains, then RoPE
    q, k, v = attn.qkv(x).split(32, dim=-1)
    heads = [t.view(2, 9, 2, 16).transpose(1, 2) for t in (q, k, v)]

    def rms(t, gain):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * gain

    qh = apply_rope(rms(heads[0], attn.q_norm.weight), rope)
    kh = apply_rope(rms(heads[1], attn.k_norm.weight), rope)
    y = torch.nn.functional.scaled_dot_product_attention(qh, kh, heads[2], is_causal=True)
    want = attn.proj(y.transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(attn(x, rope), want, rtol=1e-6, atol=1e-6)
    # so scaling the query and key projections changes nothing (up to eps), unlike without it
    plain = CausalSelfAttention(cfg_of())
    plain.load_state_dict({"qkv.weight": attn.qkv.weight, "proj.weight": attn.proj.weight})
    before, before_plain = attn(x, rope), plain(x, rope)
    with torch.no_grad():
        for module in (attn, plain):
            module.qkv.weight[:64] *= 7.0
    torch.testing.assert_close(attn(x, rope), before, rtol=1e-5, atol=1e-5)
    assert (plain(x, rope) - before_plain).abs().max() > 1e-2


@pytest.mark.parametrize("kw", [dict(recurrence="scse"), dict(recurrence="additive",
                                                              residual="preln"),
                                dict(recurrence="untied")], ids=lambda kw: kw["recurrence"])
def test_kv_cache_decode_equals_the_full_forward(kw):
    torch.manual_seed(0)
    model = with_random_gains(LoopedLM(cfg_of(qk_norm=True, **kw)).eval())
    seq = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(1))
    cache = KVCache("exact")
    with torch.no_grad():
        parts = [model.decode_step(seq[:, :6], cache, depth=3).logits]
        parts += [model.decode_step(seq[:, i:i + 1], cache, depth=3).logits for i in range(6, 15)]
        full = model(seq, depth=3).logits
        unnormed = LoopedLM(cfg_of(**kw)).eval()
        unnormed.load_state_dict({k: v for k, v in model.state_dict().items() if "_norm" not in k
                                  or "attn" not in k})
        assert (unnormed(seq, depth=3).logits - full).abs().max() > 1e-3  # qk_norm is in play
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_a_block_trains_its_gains():
    torch.manual_seed(0)
    block = Block(cfg_of(qk_norm=True))
    block(torch.randn(2, 8, 32)).square().mean().backward()
    assert block.attn.q_norm.weight.grad.abs().max() > 0
    assert block.attn.k_norm.weight.grad.abs().max() > 0


def test_a_config_saved_before_the_field_loads_with_it_off(tmp_path):
    values = config_to_dict(load_config(None, ["model.qk_norm=true"]))
    del values["model"]["qk_norm"]  # what a run saved before qk_norm existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    assert load_saved_config(tmp_path / "config.yaml").model.qk_norm is False
    values["model"]["qk_norm"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))
    assert load_saved_config(tmp_path / "config.yaml").model.qk_norm is True
