"""Blocks: residual constants and init, RoPE, the FLOPs count, depth arguments of untied."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from recurrences import over_recurrences
from scse_dist.model import Block, LoopedLM, RMSNorm, flops_per_token, residual_constants
from scse_dist.model.blocks import apply_rope, rope_tables
from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import transition_for


def cfg_of(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_heads=2, max_seq_len=64, n_prelude=1, n_core=1,
                n_coda=1, depth=4)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------ 7. residual constants


@pytest.mark.parametrize("kw,alpha,beta", [
    # N = 1 + 1*4 + 1 = 6
    (dict(residual="preln"), 1.0, 1.0),
    (dict(residual="deepnorm"), 12 ** 0.25, 48 ** -0.25),
    (dict(residual="deeploop"), 12 ** 0.5, 48 ** -0.5),
    # N = 1 + 2*8 + 1 = 18: every loop visit counts
    (dict(residual="deeploop", n_core=2, depth=8), 36 ** 0.5, 144 ** -0.5),
    (dict(residual="deepnorm", n_core=2, depth=8), 36 ** 0.25, 144 ** -0.25),
    # no block revisited -> deeploop falls back to DeepNorm
    (dict(residual="deeploop", depth=1), 6 ** 0.25, 24 ** -0.25),  # N = 3
    (dict(residual="deeploop", recurrence="untied"), 12 ** 0.25, 48 ** -0.25),  # N = 6
    (dict(residual="deeploop", recurrence="untied", untied_match="params"), 6 ** 0.25, 24 ** -0.25),
])
def test_residual_constants(kw: dict, alpha: float, beta: float) -> None:
    got = residual_constants(transition_for(cfg_of(**kw)))
    assert got == pytest.approx((alpha, beta), rel=1e-12)


def test_deeploop_constants_values() -> None:
    alpha, beta = residual_constants(transition_for(cfg_of(residual="deeploop")))
    assert alpha == pytest.approx(3.4641016, rel=1e-6) and \
        beta == pytest.approx(0.1443376, rel=1e-6)


@pytest.mark.parametrize("residual", ["deepnorm", "deeploop"])
def test_post_ln_init_uses_beta_gain_on_value_output_and_ffn(residual: str) -> None:
    torch.manual_seed(0)
    cfg = cfg_of(d_model=256, n_heads=4, residual=residual, ffn_hidden=256)
    _, beta = residual_constants(transition_for(cfg))
    block = Block(cfg)
    xavier = math.sqrt(2 / (256 + 256))  # every matrix here is 256 x 256
    q, k, v = block.attn.qkv.weight.split(256, dim=0)
    for w in (q, k):
        assert w.std().item() == pytest.approx(xavier, rel=0.03)
    for w in (v, block.attn.proj.weight, block.mlp.down.weight, block.mlp.gate.weight):
        assert w.std().item() == pytest.approx(beta * xavier, rel=0.03)


def test_post_ln_block_output_is_normalised_and_preln_is_residual() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32) * 5
    post = Block(cfg_of(residual="deeploop"))
    rms = post(x).pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)  # norm weight 1
    pre = Block(cfg_of(residual="preln"))
    with torch.no_grad():  # zero the branches' output projections: pre-LN block is the identity
        pre.attn.proj.weight.zero_()
        pre.mlp.down.weight.zero_()
    assert torch.equal(pre(x), x)


def test_rmsnorm_matches_formula() -> None:
    x = torch.randn(3, 5, 16)
    norm = RMSNorm(16, eps=1e-6)
    torch.testing.assert_close(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rope_scores_depend_only_on_relative_position() -> None:
    torch.manual_seed(0)
    seq = 12
    rope = rope_tables(seq, cfg_of(d_model=16, n_heads=2, rope_theta=10000.0), torch.device("cpu"))
    q, k = torch.randn(8), torch.randn(8)
    qs = apply_rope(q.expand(1, 1, seq, 8).contiguous(), rope)[0, 0]
    ks = apply_rope(k.expand(1, 1, seq, 8).contiguous(), rope)[0, 0]
    # <R_i q, R_j k> depends on i - j only
    torch.testing.assert_close(qs[5] @ ks[2], qs[9] @ ks[6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qs[0] @ ks[0], q @ k, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[4])


# ------------------------------------------------------------------ FLOPs


def test_flops_hand_count() -> None:
    d, f, v, s = 64, 192, 100, 32  # f: 8/3 * 64 = 170 rounded up to 192
    cfg = cfg_of(d_model=d, n_heads=2, vocab_size=v, n_core=2, recurrence="scse", inject="concat")
    assert cfg.resolved_ffn_hidden == f
    block = 2 * (4 * 64 * 64 + 3 * 64 * 192) + 2 * 2 * 32 * 64  # = 114688
    # T = 3 -> scse makes 4 core calls: 1 + 2*4 + 1 = 10 blocks; adapter per call; anchor once
    forward = 10 * block + 2 * 64 * 100 + 4 * 2 * 128 * 64 + 2 * 64 * 64
    assert forward == 1_233_408
    assert flops_per_token(cfg, depth=3, seq_len=s) == 3 * forward
    looped = cfg_of(d_model=d, n_heads=2, vocab_size=v, n_core=2, recurrence="looped")
    assert flops_per_token(looped, depth=3, seq_len=s) == 3 * (8 * block + 2 * 64 * 100)


@over_recurrences(loops_only=True)
@pytest.mark.parametrize("inject", ["none", "add", "concat"])
@pytest.mark.parametrize("backprop_steps", [0, 2])
def test_flops_match_torch_flop_counter(recurrence: str, inject: str,
                                        backprop_steps: int) -> None:
    # torch's counter sees every matmul of forward and backward (2 per MAC, as here) but not the
    # CPU SDPA kernel: with our attention term taken out, the two must agree exactly. With
    # backprop_steps=2 of depth 3, the first loop step's core call has no backward.
    if backprop_steps and inject == "none":
        pytest.skip("inject none: the prelude has no gradient path past a frozen step, so its "
                    "backward is skipped too (a prelude that cannot train; not counted)")
    cfg = cfg_of(recurrence=recurrence, inject=inject, tie_embeddings=False)
    model = LoopedLM(cfg)
    toks = torch.randint(0, 64, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(toks, toks, depth=3, backprop_steps=backprop_steps).loss.backward()
    blocks = 1 + 3 + model.core.transition.extra_core_calls + 1
    frozen = 1 if backprop_steps else 0
    attention = (3 * (blocks - frozen) + frozen) * 2 * 2 * 16 * 32
    assert counter.get_total_flops() / toks.numel() == \
        flops_per_token(cfg, 3, 16, backprop_steps) - attention


# ------------------------------------------------------------------ untied depth rules


def test_untied_fixed_depth_and_depth_errors() -> None:
    model = LoopedLM(cfg_of(recurrence="untied", residual="preln", depth=3))
    assert model.fixed_depth == 3 and len(model.core.blocks) == 3
    assert LoopedLM(cfg_of(recurrence="looped")).fixed_depth is None
    toks = torch.randint(0, 64, (1, 8))
    assert model(toks).depth == 3 and model(toks, depth=3).core_calls == 3
    with pytest.raises(ValueError, match="untied.*fixed depth 3"):
        model(toks, depth=4)
    with pytest.raises(ValueError, match="fixed depth 3"):
        model(toks, readout_depths=[1, 3])
    with pytest.raises(ValueError, match="fixed depth 3"):
        flops_per_token(model.cfg, depth=2, seq_len=8)


def test_bad_depths_raise() -> None:
    model = LoopedLM(cfg_of())
    toks = torch.randint(0, 64, (1, 8))
    with pytest.raises(ValueError, match="depth"):
        model(toks, depth=0)
    with pytest.raises(ValueError, match="readout_depths"):
        model(toks, readout_depths=[])


def test_frozen_start_is_refused() -> None:
    with pytest.raises(ValueError, match="model.init_state: anchor=zero with init_state=zeros"):
        LoopedLM(cfg_of(anchor="zero", init_state="zeros", inject="add"))
    with pytest.raises(ValueError, match="model.init_state: anchor=source with init_state=source"):
        LoopedLM(cfg_of(anchor="source", init_state="source"))
    # lambda > 0 moves a zero deviation, so the same start is allowed
    LoopedLM(cfg_of(anchor="zero", init_state="zeros", inject="add", forcing_bias_scale=0.5,
                    zero_mask=False))


@over_recurrences()
def test_rope_tables_are_made_once_per_forward(recurrence: str, monkeypatch) -> None:
    import scse_dist.model.blocks as blocks
    import scse_dist.model.looped_lm as looped_lm
    import scse_dist.model.recurrence as rec

    made, original = [], blocks.rope_tables

    def counted(*args):
        made.append(args[0])
        return original(*args)

    for module in (blocks, looped_lm, rec):
        monkeypatch.setattr(module, "rope_tables", counted)
    model = LoopedLM(cfg_of(recurrence=recurrence, residual="preln", n_core=2,
                            activation_checkpointing="block"))
    toks = torch.randint(0, 64, (2, 16))
    out = model(toks, toks, depth=4, keep_logits=False)
    out.loss.backward()  # checkpointed blocks recompute with the same tables
    assert made == [16]
    made.clear()
    list(model.iter_depth_logits(toks[:, :9], [4] if model.fixed_depth else [1, 4]))
    assert made == [9]


def test_rope_tables_values_and_their_cached_frequencies() -> None:
    """Bit for bit the formula (the frequencies are made once per size and device), also for
    position ids; the cached frequencies are made outside inference mode even when first asked
    for inside it (scse-eval's forwards), so later autograd may use them."""
    from scse_dist.model import blocks

    cfg = cfg_of(d_model=32, n_heads=2, rope_theta=500.0)
    blocks._inv_freq.cache_clear()
    with torch.inference_mode():
        cos, sin = rope_tables(6, cfg, torch.device("cpu"))
    assert not blocks._inv_freq(8, 500.0, torch.device("cpu")).is_inference()
    inv_freq = 500.0 ** (-torch.arange(0, 8, dtype=torch.float32) / 8)
    angles = torch.outer(torch.arange(6, dtype=torch.float32), inv_freq)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())
    ids = torch.tensor([[0, 0, 1], [3, 4, 5]])
    cos, sin = rope_tables(3, cfg, "cpu", ids)
    assert cos.shape == (2, 1, 3, 8) and torch.equal(cos[1, 0], angles[3:].cos())
    assert torch.equal(sin[0, 0, 1], angles[0].sin())


def test_rope_tables_stay_fp32_in_a_bf16_model() -> None:
    model = LoopedLM(cfg_of())
    toks = torch.randint(0, 64, (2, 16))
    want = model.rope(toks)
    got = model.to(torch.bfloat16).rope(toks)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert model(toks).logits.dtype == torch.bfloat16
