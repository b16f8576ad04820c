"""SCSE's algebra: exact anchor invariance, lambda=1 ablation, core-call counts, multi-depth
read-out and diagnostics."""

from __future__ import annotations

import pytest
import torch

from recurrences import over_recurrences
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, d_model=32, n_heads=2, max_seq_len=64, n_prelude=1, n_core=2,
                n_coda=1, depth=4)
    base.update(kw)
    return ModelConfig(**base)


def tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ 1. exact anchor invariance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", ["preln", "deeploop"])
def test_zero_deviation_stays_bitwise_at_anchor(dtype: torch.dtype, residual: str) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(residual=residual)).to(dtype)
    core = model.core
    for batch, seq, depth in [(1, 8, 1), (3, 17, 5), (2, 64, 12)]:
        with torch.no_grad():
            s = model.source(tokens(batch, seq))
            anchor = core.anchor_of(s)
            assert anchor.abs().max() > 0  # a zero anchor would make the test trivial
            states = core(s, depth, readout_depths=range(1, depth + 1),
                          initial_state=anchor.clone())
            x, ctx = core.start(s, anchor.clone())
            for t in range(depth):
                x = core.step(x, ctx, t)
                assert not x.any(), f"D_{t + 1} nonzero"
        assert len(states) == depth
        for t, h in enumerate(states, start=1):
            assert torch.equal(h, anchor), f"h_{t} != h* ({dtype}, T={depth})"


def _mixed_start(model: LoopedLM, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    anchor = model.core.anchor_of(s)
    h0 = model.core.initial_state(s).clone()  # source: D_0 = s - Qs, nonzero
    h0[0] = anchor[0]  # a whole sequence at its anchor
    h0[1, 5] = anchor[1, 5]  # one token at its anchor inside a moving sequence
    return anchor, h0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_anchored_rows_stay_while_others_move(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    model = LoopedLM(tiny(residual="deeploop")).to(dtype)
    depth = 6
    with torch.no_grad():
        s = model.source(tokens(3, 16, seed=1))
        anchor, h0 = _mixed_start(model, s)
        states = model.core(s, depth, readout_depths=range(1, depth + 1), initial_state=h0)
    for h in states:
        assert torch.equal(h[0], anchor[0])
        assert torch.equal(h[1, 5], anchor[1, 5])
        # every other token has left its anchor
        for moved, anc in ((h[1, :5], anchor[1, :5]), (h[1, 6:], anchor[1, 6:]), (h[2], anchor[2])):
            assert (moved - anc).abs().amax(dim=-1).gt(0).all()


def test_without_mask_a_zero_row_is_moved_by_attention() -> None:
    torch.manual_seed(1)
    model = LoopedLM(tiny(residual="deeploop", zero_mask=False))
    with torch.no_grad():
        s = model.source(tokens(3, 16, seed=1))
        anchor, h0 = _mixed_start(model, s)
        (h,) = model.core(s, 3, initial_state=h0)
    # Token 5 of sequence 1 attends to moving tokens 0..4: unmasked, it leaves its anchor.
    assert (h[1, 5] - anchor[1, 5]).abs().max() > 1e-4
    # The very first token attends only to itself: it stays without the mask too (lambda = 0).
    with torch.no_grad():
        h0[1, 0] = anchor[1, 0]
        (h,) = model.core(s, 3, initial_state=h0)
    assert torch.equal(h[1, 0], anchor[1, 0])


# ------------------------------------------------------------------ 2. lambda = 1 ablation


@pytest.mark.parametrize("inject", ["none", "add", "concat"])
def test_lambda_one_without_mask_is_the_uncentered_recurrence(inject: str) -> None:
    torch.manual_seed(2)
    cfg = tiny(residual="deeploop", forcing_bias_scale=1.0, zero_mask=False, inject=inject)
    model = LoopedLM(cfg)
    toks, depth = tokens(2, 16, seed=2), 5
    with torch.no_grad():
        s = model.source(toks)
        h = model.core.initial_state(s)
        for _ in range(depth):
            h = model.core.phi(h, s)
        out = model(toks, depth=depth)
        by_hand = model.readout(h)
        (state,) = model.core(s, depth)
    torch.testing.assert_close(state, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, by_hand, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ 3. parameters and core calls


@over_recurrences(loops_only=True)
def test_param_count_independent_of_depth(recurrence: str) -> None:
    counts = {LoopedLM(tiny(recurrence=recurrence, depth=t)).num_parameters() for t in (1, 4, 16)}
    assert len(counts) == 1


def test_untied_param_counts_follow_the_match() -> None:
    block = sum(p.numel() for p in LoopedLM(tiny()).core.blocks[0].parameters())
    deep = {t: LoopedLM(tiny(recurrence="untied", residual="preln", depth=t)).num_parameters()
            for t in (2, 5)}
    assert deep[5] - deep[2] == 3 * 2 * block  # n_core=2 distinct blocks per extra step
    flat = LoopedLM(tiny(recurrence="untied", untied_match="params", residual="preln"))
    looped = LoopedLM(tiny(recurrence="looped", residual="preln"))
    assert flat.num_parameters() == looped.num_parameters()
    assert len(flat.core.blocks) == 2 and flat.fixed_depth == 1


@over_recurrences(loops_only=True)
def test_core_calls_count_phi_applications(recurrence: str) -> None:
    model = LoopedLM(tiny(recurrence=recurrence))
    extra = model.core.transition.extra_core_calls  # scse: r* = Phi(h*) once per forward
    seen = []
    # Count real calls of the first core block: one per Phi application.
    model.core.blocks[0].register_forward_hook(lambda *_: seen.append(1))
    for depth in (1, 3, 7):
        seen.clear()
        with torch.no_grad():
            out = model(tokens(2, 8), depth=depth)
        assert out.core_calls == depth + extra == len(seen)
        assert out.depth == depth


# ------------------------------------------------------------------ 5. multi-depth read-out


@over_recurrences(loops_only=True)
def test_multi_depth_readout_equals_separate_runs(recurrence: str) -> None:
    torch.manual_seed(3)
    model = LoopedLM(tiny(recurrence=recurrence, residual="deeploop"))
    toks = tokens(2, 16, seed=3)
    with torch.no_grad():
        multi = model(toks, toks, readout_depths=[8, 1, 4, 2])
        for t in (1, 2, 4, 8):
            single = model(toks, toks, depth=t)
            assert torch.equal(multi.logits_by_depth[t], single.logits)
            assert torch.equal(multi.loss_by_depth[t], single.loss)
    assert multi.depth == 8 and torch.equal(multi.logits, multi.logits_by_depth[8])
    assert multi.core_calls == 8 + model.core.transition.extra_core_calls
    assert sorted(multi.logits_by_depth) == [1, 2, 4, 8]
    # the lazy per-depth read-out (what evaluation uses) gives the same logits, in depth order
    with torch.no_grad():
        lazy = list(model.iter_depth_logits(toks, [8, 1, 4, 2]))
    assert [t for t, _ in lazy] == [1, 2, 4, 8]
    assert all(torch.equal(logits, multi.logits_by_depth[t]) for t, logits in lazy)


def test_keep_logits_false_keeps_losses_only() -> None:
    model = LoopedLM(tiny())
    toks = tokens(2, 8)
    with torch.no_grad():
        out = model(toks, toks, readout_depths=[1, 3], keep_logits=False)
        ref = model(toks, toks, depth=3)
    assert out.logits is None and out.logits_by_depth is None
    # keep_logits=False computes the loss in chunks (scse_dist.model.loss): same value up to
    # fp32 summation order (tests/test_model_loss.py checks the gradients too).
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert sorted(out.loss_by_depth) == [1, 3]


# ------------------------------------------------------------------ 8. diagnostics


@over_recurrences(loops_only=True)
def test_the_loop_trace_measures_the_forward_states(recurrence: str) -> None:
    torch.manual_seed(4)
    model = LoopedLM(tiny(recurrence=recurrence))
    toks, depth = tokens(2, 16, seed=4), 5
    with torch.no_grad():
        s = model.source(toks)
        anchor = model.core.anchor_of(s)
        states = model.core(s, depth, readout_depths=range(1, depth + 1))
        trace = model.core.trace(s, depth, keep=(0, 2, depth))
        bias = model.core.forcing_bias_norm(trace.ctx)
    assert trace.deviation_norm.shape == (depth + 1,) and trace.motion_norm.shape == (depth,)
    assert bias.shape == ()
    h = [model.core.initial_state(s), *states]
    assert sorted(trace.states) == [0, 2, depth]
    for t, state in trace.states.items():
        torch.testing.assert_close(state, h[t])
    want_dev = torch.stack([(x - anchor).norm(dim=-1).mean() for x in h])
    want_motion = torch.stack([(b - a).norm(dim=-1).mean() for a, b in zip(h, h[1:])])
    torch.testing.assert_close(trace.deviation_norm, want_dev)
    torch.testing.assert_close(trace.motion_norm, want_motion)
    if model.core.transition.has_anchor:  # scse at lambda 0: no forcing bias at its anchor
        assert bias.item() == 0.0
    else:
        with torch.no_grad():
            want_b = (model.core.phi(s, s) - s).norm(dim=-1).mean()
        assert bias.item() > 0
        torch.testing.assert_close(bias, want_b)


def test_scse_forcing_bias_norm_scales_with_lambda() -> None:
    norms = {}
    for lam in (0.25, 0.5):
        torch.manual_seed(5)
        model = LoopedLM(tiny(forcing_bias_scale=lam, zero_mask=False))
        with torch.no_grad():
            trace = model.core.trace(model.source(tokens(2, 8)), 1)
            norms[lam] = model.core.forcing_bias_norm(trace.ctx)
    assert norms[0.25] > 0
    torch.testing.assert_close(norms[0.5], 2 * norms[0.25])
