"""Batched inference: attention_mask and position_ids. A left-padded batch gives each sequence
the logits it gets alone, unpadded; without them the training path (is_causal SDPA) runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

KINDS = [dict(recurrence="untied"), dict(recurrence="looped"), dict(recurrence="additive"),
         dict(recurrence="scse"), dict(recurrence="scse", inject="concat", residual="preln")]


def tiny(depth: int, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=64, n_prelude=1,
                       n_core=2, n_coda=1, depth=depth, **kw)


def left_pad(seqs: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(q) for q in seqs)
    tokens = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, q in enumerate(seqs):
        tokens[i, width - len(q):], mask[i, width - len(q):] = q, 1
    return tokens, mask


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_left_padded_batch_equals_each_sequence_alone(kw: dict, depth: int) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(depth, **kw)).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (12, 5, 9, 1)]
    tokens, mask = left_pad(seqs, pad=7)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(tokens, depth=depth, attention_mask=mask, position_ids=positions).logits
        derived = model(tokens, depth=depth, attention_mask=mask).logits  # positions from mask
        other_pad = model(tokens.masked_fill(mask == 0, 3), depth=depth, attention_mask=mask).logits
        for i, q in enumerate(seqs):
            alone = model(q[None], depth=depth).logits[0]
            got = batched[i, tokens.shape[1] - len(q):]
            torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    assert torch.equal(derived, batched)
    real = mask.bool()
    torch.testing.assert_close(other_pad[real], batched[real], rtol=0, atol=1e-6)


def test_no_mask_keeps_the_causal_kernel_call(monkeypatch) -> None:
    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(*args, **kwargs):
        calls.append(sorted(kwargs.items(), key=lambda kv: kv[0]) if "attn_mask" not in kwargs
                     else "attn_mask")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    model = LoopedLM(tiny(3))
    tokens = torch.randint(0, 64, (2, 6))
    model(tokens)
    assert calls and all(c == [("is_causal", True)] for c in calls)
    calls.clear()
    model(tokens, attention_mask=torch.ones_like(tokens))
    assert calls and all(c == "attn_mask" for c in calls)


def test_explicit_positions_from_zero_match_the_default() -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(4)).eval()
    tokens = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        default = model(tokens).logits
        shifted = model(tokens, position_ids=torch.arange(10).expand(2, 10)).logits
        full_mask = model(tokens, attention_mask=torch.ones_like(tokens)).logits
    torch.testing.assert_close(shifted, default, rtol=0, atol=1e-6)
    torch.testing.assert_close(full_mask, default, rtol=0, atol=1e-6)
