"""The chunked LM loss (keep_logits=False) equals the full-logits loss, gradients included, and
never forms a (B, S, V) tensor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import scse_dist.model.loss as loss_module
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

VOCAB = 97


def model_of(**kw) -> LoopedLM:
    torch.manual_seed(0)
    base = dict(vocab_size=VOCAB, d_model=32, n_heads=2, max_seq_len=64, depth=3)
    return LoopedLM(ModelConfig(**{**base, **kw}))


def batch(ignored: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 20), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 20), generator=gen)
    if ignored:
        targets[0, :7] = -100  # a padded stretch, and single tokens inside two chunks
        targets[1, 11] = targets[2, 19] = -100
    return tokens, targets


def loss_and_grads(model: LoopedLM, keep_logits: bool, **kw) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    tokens, targets = batch(kw.pop("ignored", True))
    out = model(tokens, targets, keep_logits=keep_logits, **kw)
    loss = out.loss if out.loss_by_depth is None else sum(out.loss_by_depth.values())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def small_chunks(monkeypatch):
    # 7 rows per chunk: 60 tokens make 9 chunks, the last one short.
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", VOCAB * 7)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("ignored", [True, False])
def test_chunked_loss_and_every_gradient_match_full_logits(small_chunks, tie: bool,
                                                           ignored: bool) -> None:
    model = model_of(tie_embeddings=tie)
    want, want_grads = loss_and_grads(model, keep_logits=True, ignored=ignored)
    got, got_grads = loss_and_grads(model, keep_logits=False, ignored=ignored)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want_grads.keys() == got_grads.keys()
    assert ("head.weight" in got_grads) == (not tie)
    for name, grad in want_grads.items():
        assert grad.abs().max() > 0, name  # every parameter gets a gradient on this path
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_ignored_targets_leave_the_mean_over_the_others(small_chunks) -> None:
    model = model_of()
    tokens, targets = batch(ignored=True)
    with torch.no_grad():
        logits = model(tokens).logits
        rows = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(0),
                                                 reduction="none")
        kept = targets.flatten() != -100
        got = model(tokens, targets, keep_logits=False).loss
        none_kept = model(tokens, torch.full_like(targets, -100), keep_logits=False).loss
    assert kept.sum() == 60 - 9
    torch.testing.assert_close(got, rows[kept].mean())
    assert math.isnan(none_kept.item())  # 0/0, as F.cross_entropy gives


def test_chunked_loss_by_depth_matches(small_chunks) -> None:
    model = model_of(recurrence="additive")
    want, want_grads = loss_and_grads(model, keep_logits=True, readout_depths=[1, 3])
    got, got_grads = loss_and_grads(model, keep_logits=False, readout_depths=[1, 3])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_chunked_loss_matches_full_logits(small_chunks) -> None:
    model = model_of().to(torch.bfloat16)
    want, want_grads = loss_and_grads(model, keep_logits=True)
    got, got_grads = loss_and_grads(model, keep_logits=False)
    assert got.dtype == torch.float32  # the loss itself is fp32, as before
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for name in ("embed.weight", "norm.weight", "core.blocks.0.attn.qkv.weight"):
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=2e-2, atol=2e-3)


class LargestOutput(TorchDispatchMode):
    """Largest numel any op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("keep_logits", [True, False])
def test_no_full_vocabulary_tensor_in_the_chunked_loss(small_chunks, keep_logits: bool) -> None:
    model = model_of(d_model=16, ffn_hidden=32)
    tokens, targets = batch(ignored=True)
    hidden = model.head_input(model.core(model.source(tokens), 3)[0]).detach().requires_grad_()
    full = tokens.numel() * VOCAB  # 5820 logits; the (V, d) head gradient has 1552
    with LargestOutput() as seen:
        if keep_logits:
            logits = torch.nn.functional.linear(hidden, model.head_weight).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        else:
            loss = loss_module.chunked_cross_entropy(hidden, model.head_weight, targets)
        loss.backward()
    if keep_logits:
        assert seen.largest >= full
    else:
        assert seen.largest <= max(7 * VOCAB, VOCAB * 16)


# --------------------------------------------------------------------------- z-loss


def direct_terms(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 z_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, z term) the textbook way: full fp32 logits, autograd."""
    logits = torch.nn.functional.linear(hidden, weight).float().flatten(0, 1)
    kept = targets.flatten() != -100
    ce = torch.nn.functional.cross_entropy(logits, targets.flatten(), ignore_index=-100)
    z = z_weight * logits.logsumexp(-1)[kept].square().mean()
    return ce, z


@pytest.mark.parametrize("ignored", [True, False])
def test_z_loss_equals_the_direct_computation_value_and_gradient(small_chunks, ignored) -> None:
    gen = torch.Generator().manual_seed(3)
    _, targets = batch(ignored)
    # logits of a few units: lse^2 ~ 25, so the weight below makes the term visible
    hidden = (3 * torch.randn(3, 20, 16, generator=gen)).requires_grad_()
    weight = torch.randn(VOCAB, 16, generator=gen).requires_grad_()
    w = 0.01
    ce, z = direct_terms(hidden, weight, targets, w)
    (ce + z).backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    terms = loss_module.chunked_cross_entropy_with_z_loss(hidden, weight, targets, w)
    assert z > 0.1 * ce  # the term is not negligible here, so its gradient is tested
    torch.testing.assert_close(terms.z_loss, z, rtol=1e-6, atol=0)
    torch.testing.assert_close(terms.cross_entropy, ce, rtol=1e-6, atol=0)
    assert terms.objective.item() == (terms.cross_entropy + terms.z_loss).item()
    assert not terms.cross_entropy.requires_grad and not terms.z_loss.requires_grad
    terms.objective.backward()
    torch.testing.assert_close(hidden.grad, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, want_w, rtol=1e-5, atol=1e-6)
    # the z term's share of the gradient is large here, so a gradient without it would fail above
    ce_only, _ = direct_terms(hidden, weight, targets, w)
    ce_grad = torch.autograd.grad(ce_only, hidden)[0]
    assert (ce_grad - want_h).abs().max() > 0.1 * want_h.abs().max()


def test_z_loss_in_the_model_chunked_equals_full_logits(small_chunks) -> None:
    model = model_of()
    tokens, targets = batch(ignored=True)
    outs = {}
    for keep in (True, False):
        model.zero_grad(set_to_none=True)
        out = model(tokens, targets, keep_logits=keep, z_loss=1e-2)
        out.objective.backward()
        outs[keep] = (out, {n: p.grad.clone() for n, p in model.named_parameters()})
    (full, full_grads), (chunked, chunked_grads) = outs[True], outs[False]
    torch.testing.assert_close(chunked.z_loss, full.z_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked.loss, full.loss.detach(), rtol=1e-6, atol=1e-6)
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # the loss a caller reads is the cross-entropy alone, as without z_loss
    plain = model(tokens, targets, keep_logits=False)
    assert plain.z_loss is None and plain.objective is None
    assert plain.loss.item() == chunked.loss.item()
    with pytest.raises(ValueError, match="z_loss: a term of the training loss; it needs targets"):
        model(tokens, z_loss=1e-4)


def test_chunks_are_torchtitans_8192_rows_on_cuda_and_unchanged_off_it() -> None:
    """Off CUDA the 64 MiB chunks the quickstart was measured with (a different size reorders the
    fp32 sums: its numbers stay bit for bit); on CUDA 8192 rows, within a 64th of the memory."""
    assert loss_module.chunk_rows(32000) == (1 << 24) // 32000 == 524
    assert [s.stop - s.start for s in loss_module._chunks(1100, 32000, torch.device("cpu"))] == \
        [524, 524, 52]
    assert loss_module.chunk_rows(32000, cuda_memory=81559 * 2**20) == 8192  # an H100
    assert loss_module.chunk_rows(32000, cuda_memory=8 * 2**30) == 8 * 2**30 // 64 // 128000
    assert loss_module.chunk_rows(10**9, cuda_memory=2**30) == 1
    # the planner counts the same chunks: 3 x 1 GiB of fp32 logits at 16 x 1024 tokens
    from scse_dist.train.sizing import loss_chunks_bytes
    assert loss_chunks_bytes(32000, 16384, 81559 * 2**20) == 8192 * 32000 * 4 * 3
    assert loss_chunks_bytes(32000, 16384) == 524 * 32000 * 4 * 3
