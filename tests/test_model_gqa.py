"""Grouped-query attention (model.n_kv_heads) and the head width (model.head_dim).

Unset, both leave today's attention bit for bit: the weights and logits of fixed-seed models
hash to what the code before the fields gave. Set: attention equals a hand-written reference that
repeats each k/v head over its group; a GQA model equals its multi-head expansion (k/v rows
repeated) on every path that attends (the full forward, both KV-cache modes, speculative decoding,
adaptive exit, the document mask through SDPA and FlexAttention), while its cache holds n_kv_heads
heads; it trains; the FLOPs and the planner's parameters shrink as counted by hand. (The Hugging
Face export's logits with GQA: tests/test_hf_export.py; the saved activations: test_sizing.py.)
"""

from __future__ import annotations

import hashlib
import math
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scse_dist.config import load_config
from scse_dist.generate import generate
from scse_dist.model import LoopedLM, flops_per_token
from scse_dist.model.blocks import CausalSelfAttention, apply_rope, attention_mask_4d, rope_tables
from scse_dist.model.config import ModelConfig
from scse_dist.model.documents import BACKEND_ENV, document_ids, flex_attention
from scse_dist.model.exit_rules import parse_exit_rule
from scse_dist.model.kv_cache import KVCache
from scse_dist.train.sizing import count_parameters
from scse_dist.typed_yaml import ConfigError
from test_model_compile import assert_same_step, compiles, fresh_dynamo  # noqa: F401
from train_procs import read_metrics, run_trainer

EOS = 2
KINDS = [dict(recurrence="scse"), dict(recurrence="additive", residual="preln"),
         dict(recurrence="untied", residual="preln"), dict(recurrence="scse", qk_norm=True)]
# (n_heads, n_kv_heads, head_dim) at d_model 32: 4:1, 2:1, a head_dim not d_model / n_heads
SHAPES = [(4, 1, None), (4, 2, None), (4, 1, 12), (2, 2, 24)]


def kind_id(kw: dict) -> str:
    return "-".join(map(str, kw.values()))


def cfg_of(**kw) -> ModelConfig:
    # 4:1 with two k/v heads (so a wrong head-to-group map shows), heads wider than 32 / 8
    base = dict(vocab_size=64, d_model=32, n_heads=8, n_kv_heads=2, head_dim=8, ffn_hidden=64,
                max_seq_len=64, n_prelude=1, n_core=2, n_coda=1, depth=3)
    return ModelConfig(**{**base, **kw})


def shaken(model: LoopedLM) -> LoopedLM:
    """Weights moved off their init (norm gains too), so tokens vary and no path hides."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def gqa_model(**kw) -> LoopedLM:
    torch.manual_seed(0)
    return shaken(LoopedLM(cfg_of(**kw)))


def expanded(model: LoopedLM) -> LoopedLM:
    """The multi-head model that computes what a GQA one does: each k/v head's rows repeated
    for every query head of its group."""
    cfg = model.cfg
    mha = LoopedLM(ModelConfig(**{**cfg.__dict__, "n_kv_heads": None,
                                  "head_dim": cfg.resolved_head_dim}))
    group, hd = cfg.n_heads // cfg.resolved_n_kv_heads, cfg.resolved_head_dim
    state = {}
    for name, w in model.state_dict().items():
        if name.endswith("attn.qkv.weight"):
            q, k, v = w.split((cfg.n_heads * hd,) + (cfg.resolved_n_kv_heads * hd,) * 2)
            k, v = (t.view(-1, hd, w.shape[1]).repeat_interleave(group, 0).flatten(0, 1)
                    for t in (k, v))
            w = torch.cat([q, k, v])
        state[name] = w
    mha.load_state_dict(state)
    return mha.eval()


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------ unset: today's attention


# Recorded with the code before model.n_kv_heads / model.head_dim existed (torch 2.13 CPU, the
# commit before them): per case, sha256 of the state dict's names, shapes and bytes; the next
# torch.rand after init (the RNG's draws); sha256 of the logits' bytes and of the gradients of
# one loss.
BEFORE = {
    "deeploop": ("a29e3d7d9202ecae", 0.667160153388977, "b9c766cd0a167b32", "bf3f3134fffb640d"),
    "preln": ("fe7600cdb4032d56", 0.667160153388977, "f70c2777e4f430e4", "f598def641a22b3e"),
    "forward_qknorm": ("517dd2cefcb9e619", 0.667160153388977, "82fbcd95efd29fcf",
                       "41fd1bca433fa6c3")}
BEFORE_KW = {"deeploop": {}, "preln": dict(residual="preln"),
             "forward_qknorm": dict(branch_scale="forward", qk_norm=True)}


def fingerprint(cfg: ModelConfig) -> tuple[str, float, str, str]:
    torch.manual_seed(0)
    model = LoopedLM(cfg)
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(f"{name}{tuple(value.shape)}".encode())
        h.update(value.numpy().tobytes())
    after = torch.rand(1).item()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        logits = model(tokens).logits
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    grads = hashlib.sha256()
    for name, p in model.named_parameters():
        grads.update(name.encode())
        grads.update(p.grad.numpy().tobytes())
    return (h.hexdigest()[:16], after, hashlib.sha256(logits.numpy().tobytes()).hexdigest()[:16],
            grads.hexdigest()[:16])


@pytest.mark.parametrize("case", sorted(BEFORE))
@pytest.mark.parametrize("spelled", ["unset", "explicit"])
def test_unset_fields_are_todays_attention_bit_for_bit(case: str, spelled: str) -> None:
    extra = dict(n_kv_heads=4, head_dim=8) if spelled == "explicit" else {}
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=4, ffn_hidden=64, max_seq_len=32,
                      n_prelude=1, n_core=1, n_coda=1, depth=2, **BEFORE_KW[case], **extra)
    assert fingerprint(cfg) == BEFORE[case]


# ------------------------------------------------------------------ attention


def reference_attention(attn: CausalSelfAttention, x: torch.Tensor, rope,
                        key_mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention written out: k/v heads repeated over their query heads."""
    b, s, _ = x.shape
    h, hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split((h * hd, hkv * hd, hkv * hd), dim=-1)
    q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in (q, k, v))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    allowed = attention_mask_4d(key_mask)
    y = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return attn.proj(y.transpose(1, 2).reshape(b, s, h * hd))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding-mask"])
def test_attention_equals_a_reference_that_repeats_kv_heads(shape, masked: bool) -> None:
    n_heads, n_kv, head_dim = shape
    torch.manual_seed(0)
    cfg = cfg_of(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, qk_norm=True)
    attn = CausalSelfAttention(cfg)
    hd = cfg.resolved_head_dim
    assert attn.qkv.weight.shape == ((n_heads + 2 * n_kv) * hd, 32)
    assert attn.proj.weight.shape == (32, n_heads * hd)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32)
    key_mask = torch.ones(2, 9, dtype=torch.long)
    if masked:
        key_mask[1, :3] = 0  # left padding: the 4-d mask path (k/v heads repeated)
    rope = rope_tables(9, cfg, x.device)
    got = attn(x, rope, attention_mask_4d(key_mask) if masked else None)
    want = reference_attention(attn, x, rope, key_mask)
    rows = key_mask.bool()  # padding queries' outputs are never read
    assert (got - want)[rows].abs().max().item() <= 1e-6


def test_field_checks_name_the_field() -> None:
    divide = "must be > 0 and divide model.n_heads=4, got"
    for override, message in [
            ("model.n_kv_heads=3", f"model.n_kv_heads: {divide} 3"),
            ("model.n_kv_heads=0", f"model.n_kv_heads: {divide} 0"),
            ("model.head_dim=7", "model.head_dim: must be even and > 0 (RoPE rotates pairs), "
                                 "got 7"),
            ("model.head_dim=-2", "model.head_dim: must be even and > 0")]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert str(err.value).startswith(message) and "\n" not in str(err.value), override
    # a head_dim frees n_heads from dividing d_model (d_model 256, 3 heads of 64)
    cfg = load_config(None, ["model.n_heads=3", "model.head_dim=64", "model.n_kv_heads=1"]).model
    assert (cfg.n_heads, cfg.resolved_n_kv_heads, cfg.resolved_head_dim) == (3, 1, 64)
    with pytest.raises(ConfigError, match="model.n_heads: d_model=256 must split into 3 heads"):
        load_config(None, ["model.n_heads=3"])


# ------------------------------------------------------------------ every path that attends


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_a_gqa_model_is_its_multi_head_expansion(kw: dict) -> None:
    model = gqa_model(**kw)
    mha = expanded(model)
    tokens = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(2))
    depths = [3] if kw["recurrence"] == "untied" else [1, 3, 6]
    with torch.no_grad():
        got = model(tokens, readout_depths=depths).logits_by_depth
        want = mha(tokens, readout_depths=depths).logits_by_depth
    for t in depths:
        assert_near(got[t], want[t])
    assert count_parameters_of(model) < count_parameters_of(mha)


def count_parameters_of(model: LoopedLM) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_kv_cache_decode_equals_the_full_forward_with_n_kv_heads_cached(kw: dict) -> None:
    model = gqa_model(**kw)
    mha = expanded(model)
    seq = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(4))
    for mode in ("exact", "shared"):
        decoded = {}
        for which, m in (("gqa", model), ("mha", mha)):
            cache = KVCache(mode)
            with torch.no_grad():
                parts = [m.decode_step(seq[:, :6], cache, depth=3).logits]
                parts += [m.decode_step(seq[:, i:i + 1], cache, depth=3).logits
                          for i in range(6, 13)]
            decoded[which] = torch.cat(parts, 1), cache
        logits, cache = decoded["gqa"]
        # the cache holds n_kv_heads heads per slot: a quarter of the multi-head model's bytes
        assert {t.shape[1:] for t in cache.tensors()} == {(2, 13, 8)}
        assert cache.nbytes() * 4 == decoded["mha"][1].nbytes()
        assert_near(logits, decoded["mha"][0])
        if mode == "exact":  # the full forward's logits
            with torch.no_grad():
                assert_near(logits, model(seq, depth=3).logits)


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_speculative_and_adaptive_exit_decoding_under_gqa(kw: dict) -> None:
    model = gqa_model(**kw)
    batch = prompts(7, 3, 5)  # left-padded
    greedy = generate(model, batch, max_new_tokens=10, depth=3)
    assert min(len(set(row)) for row in greedy.tokens) >= 3  # not one repeated token
    assert generate(expanded(model), batch, max_new_tokens=10, depth=3).tokens == greedy.tokens
    if kw["recurrence"] != "untied":
        for draft in [(1, 3), (2, 2)]:
            got = generate(model, batch, max_new_tokens=10, depth=3, speculative=draft)
            assert got.tokens == greedy.tokens, draft
        rule = parse_exit_rule("motion:0.05,max=6")
        exits = generate(model, batch, max_new_tokens=6, exit_rule=rule)
        want = generate(expanded(model), batch, max_new_tokens=6, exit_rule=rule)
        assert exits.tokens == want.tokens and exits.steps == want.steps


def packed(gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    lengths = [6, 9, 5]
    docs = [torch.randint(3, 64, (n,), generator=gen) for n in lengths]
    for d in docs[1:]:
        d[0] = EOS  # an eos opens each later document
    return torch.cat(docs), lengths


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 rounding at the logits' scale (the shaken models' reach about 6)."""
    assert float((got - want).abs().max()) <= 3e-5 * max(1.0, float(want.abs().max()))


def test_document_mask_under_gqa(monkeypatch) -> None:
    """Each packed document gets its logits alone through the SDPA mask, and FlexAttention's
    logits are the SDPA mask's."""
    model = gqa_model(recurrence="scse", residual="preln", document_mask=True)
    gen = torch.Generator().manual_seed(5)
    rows = [packed(gen) for _ in range(2)]
    tokens = torch.stack([r for r, _ in rows])
    docs = document_ids(tokens, EOS)
    monkeypatch.setenv(BACKEND_ENV, "sdpa")
    with torch.no_grad():
        out = model(tokens, document_ids=docs).logits
        for b, (row, lengths) in enumerate(rows):
            start = 0
            for n in lengths:
                assert_near(out[b, start:start + n], model(row[None, start:start + n]).logits[0])
                start += n
        causal = model(tokens).logits
    assert (causal - out)[:, 6:].abs().max() > 1e-3  # the mask is in play
    if flex_attention is None:
        pytest.skip("torch without FlexAttention")
    monkeypatch.setenv(BACKEND_ENV, "flex")
    with warnings.catch_warnings(), torch.no_grad():  # flex on CPU runs unfused, and says so
        warnings.simplefilter("ignore")
        assert_near(model(tokens, document_ids=docs).logits, out)


def test_a_gqa_model_trains() -> None:
    torch.manual_seed(0)
    model = LoopedLM(cfg_of(recurrence="scse"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(6))
    losses = []
    for _ in range(8):
        loss = model(tokens[:, :-1], tokens[:, 1:], depth=3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in model.parameters())


def test_compiled_gqa_blocks_match_eager(fresh_dynamo) -> None:  # noqa: F811
    """train.engine.compile's regional compile traces grouped-query attention: one graph for
    every block and depth, the loss and gradients eager's."""
    torch.manual_seed(0)
    eager = LoopedLM(cfg_of(recurrence="scse"))
    compiled = LoopedLM(cfg_of(recurrence="scse"))
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    for depth in (2, 5):
        assert_same_step(eager, compiled, tokens, depth=depth)
    assert compiles() == 1


@pytest.mark.slow
def test_the_trainer_runs_a_gqa_model(tmp_path, tiny_config, tiny_data, subprocess_env) -> None:
    cfg = tiny_config(tmp_path, "model.n_heads=4", "model.n_kv_heads=1", "train.max_steps=10",
                      "train.log_every=1")
    run_trainer(cfg, subprocess_env)
    losses = [r["loss"] for r in read_metrics(tmp_path / "runs" / "tiny") if "kind" not in r]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert "n_kv_heads: 1" in (tmp_path / "runs" / "tiny" / "config.yaml").read_text()


# ------------------------------------------------------------------ FLOPs and parameters


def test_flops_hand_count_under_gqa() -> None:
    d, f, v, s = 64, 192, 100, 32
    cfg = cfg_of(d_model=d, n_heads=4, n_kv_heads=1, head_dim=24, vocab_size=v, ffn_hidden=f,
                 n_core=1, recurrence="looped")
    q, kv = 4 * 24, 1 * 24  # query and key/value widths
    projections = d * q + 2 * d * kv + q * d  # q, k, v, out
    block = 2 * (projections + 3 * d * f) + 2 * 2 * s * q
    # T = 3: 1 + 3 + 1 blocks and the head, 3x for training
    assert flops_per_token(cfg, depth=3, seq_len=s) == 3 * (5 * block + 2 * d * v)
    mha = cfg_of(d_model=d, n_heads=4, n_kv_heads=None, head_dim=None, vocab_size=v,
                 ffn_hidden=f, n_core=1, recurrence="looped")
    assert flops_per_token(mha, 3, s) == 3 * (5 * (2 * (4 * d * d + 3 * d * f) + 4 * s * d)
                                              + 2 * d * v)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_flops_match_torch_flop_counter_under_gqa(shape) -> None:
    """torch counts every matmul of forward and backward but not the CPU SDPA kernel: with the
    attention term taken out the two agree exactly."""
    n_heads, n_kv, head_dim = shape
    cfg = cfg_of(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, tie_embeddings=False)
    model = LoopedLM(cfg)
    toks = torch.randint(0, 64, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(toks, toks, depth=3).loss.backward()
    blocks = 1 + 2 * (3 + model.core.transition.extra_core_calls) + 1
    attention = 3 * blocks * 2 * 2 * 16 * n_heads * cfg.resolved_head_dim
    assert counter.get_total_flops() / toks.numel() == flops_per_token(cfg, 3, 16) - attention


def test_the_planner_counts_the_smaller_projections() -> None:
    base = ["model.d_model=64", "model.n_heads=4", "model.n_core=1", "model.ffn_hidden=128"]
    mha = count_parameters(load_config(None, base).model)
    gqa = count_parameters(load_config(None, base + ["model.n_kv_heads=1"]).model)
    blocks = 3  # prelude, one core block, coda
    assert mha - gqa == blocks * 2 * 64 * (64 - 16)  # k and v: 4 heads of 16 -> 1
