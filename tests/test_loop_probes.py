"""Issue 26's diagnostics: parameter groups, update-to-weight ratios, the core's Jacobian gain and
its sub-layer ratios at the anchor, each against a direct computation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from recurrences import over_recurrences
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.param_groups import PARAM_GROUPS, group_of
from scse_dist.train.callbacks.diagnostics import LoopDiagnosticsCallback
from scse_dist.train.config import TrainConfig
from scse_dist.train.core_probes import jacobian_gain, phi_jacobian, sublayer_ratios
from scse_dist.train.diagnostics import loop_diagnostics, update_ratios, weights_snapshot


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=3),
                          **kw})


def model_of(seed: int = 0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(tiny(**kw)).eval()


WINDOW = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
VARIANTS = [dict(zip(("residual", "inject", "qk_norm", "tie_embeddings", "anchor", "n_core",
                      "untied_match"), v))
            for v in itertools.product(("preln", "deeploop"), ("default", "add", "concat"),
                                       (False, True), (True, False), ("learned", "source"),
                                       (1, 2), ("depth", "params"))]


@over_recurrences()
def test_every_parameter_of_every_variant_has_a_group(recurrence) -> None:
    built = 0
    for fields in VARIANTS:
        try:
            model = LoopedLM(tiny(recurrence=recurrence, **fields))
        except ValueError:
            continue  # a combination this recurrence refuses (untied with an inject, ...)
        built += 1
        for name, _ in model.named_parameters():
            assert group_of(name) in PARAM_GROUPS, name
    assert built > 0


def test_the_groups_by_name() -> None:
    model = LoopedLM(tiny(inject="concat", qk_norm=True, tie_embeddings=False))
    groups = {name: group_of(name) for name, _ in model.named_parameters()}
    assert set(groups.values()) == set(PARAM_GROUPS)
    expected = {"embed.weight": "embed", "head.weight": "head", "norm.weight": "norm",
                "core.anchor.weight": "anchor", "core.adapter.weight": "adapter",
                "core.blocks.0.attn.qkv.weight": "core_attn",
                "core.blocks.0.attn.q_norm.weight": "norm",
                "core.blocks.0.mlp.down.weight": "core_mlp", "core.blocks.0.norm2.weight": "norm",
                "prelude.0.attn.proj.weight": "prelude", "prelude.0.norm1.weight": "norm",
                "coda.0.mlp.gate.weight": "coda"}
    assert {k: groups[k] for k in expected} == expected
    with pytest.raises(ValueError, match="parameter 'core.gate.weight' is in no group"):
        group_of("core.gate.weight")


def test_update_ratio_of_a_known_step() -> None:
    """An SGD step moves each weight by -lr * grad: the ratio is lr * ||grad_g|| / ||W_g||."""
    model = model_of()
    grads = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
             for i, (name, p) in enumerate(model.named_parameters())}
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    model.core.anchor.weight.grad.zero_()  # a group that does not move
    before = weights_snapshot(model)
    lr = 0.01
    torch.optim.SGD(model.parameters(), lr=lr).step()
    got = update_ratios(model, before)
    for g in ("embed", "prelude", "core_attn", "core_mlp", "coda", "norm"):
        names = [n for n in grads if group_of(n) == g]
        moved = math.sqrt(sum(float(grads[n].pow(2).sum()) for n in names)) * lr
        size = math.sqrt(sum(float(before[n].pow(2).sum()) for n in names))
        assert got[f"diag/update_ratio_{g}"] == pytest.approx(moved / size, rel=1e-4)
        largest = max(lr * float(grads[n].norm()) / float(before[n].norm()) for n in names)
        assert got[f"diag/update_ratio_max_{g}"] == pytest.approx(largest, rel=1e-4)
    assert got["diag/update_ratio_anchor"] == got["diag/update_ratio_max_anchor"] == 0.0
    assert "diag/update_ratio_head" not in got  # tied: no such group in this model


def test_callback_reports_the_update_of_its_step() -> None:
    model = model_of()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def state(step: int):
        from types import SimpleNamespace

        engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: 0)
        return SimpleNamespace(engine=engine, step=step, rank0=True, metrics_extra={},
                               step_seconds=0.0)

    callback = LoopDiagnosticsCallback(LoopDiagnosticsCallback.Config(every_steps=2),
                                       TrainConfig(), tiny(), window=WINDOW)  # T = 3, fixed
    callback.on_start(state(0))
    rows = {}
    for step in (1, 2):
        model(WINDOW[:, :-1], WINDOW[:, 1:], keep_logits=False).loss.backward()
        callback.before_update(state(step - 1))
        weights = weights_snapshot(model)
        optimizer.step()
        optimizer.zero_grad()
        after = state(step)
        callback.on_step_end(after)
        rows[step] = (after.metrics_extra, update_ratios(model, weights))
    assert rows[1][0] == {}  # not a diagnostics step: no copy kept, nothing logged
    row, direct = rows[2]
    assert {k: row[k] for k in direct} == direct and direct["diag/update_ratio_core_mlp"] > 0
    assert callback._before == {}  # the copy lives for one step only


def test_jacobian_gain_of_a_linear_map_is_its_spectral_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen)
    start = torch.randn(2, 5, 16, generator=gen)
    along, top = jacobian_gain(lambda x: x @ a.T, torch.randn(2, 5, 16, generator=gen), start,
                               iters=60)
    assert top == pytest.approx(float(torch.linalg.matrix_norm(a, 2)), rel=1e-4)
    assert along == pytest.approx(float((start @ a.T).norm() / start.norm()), rel=1e-6)
    # a few iterations: a lower bound, already close for a clear gap between singular values
    u, _, vh = torch.linalg.svd(a)
    gapped = u @ torch.diag(torch.linspace(3.0, 0.5, 16)) @ vh
    _, few = jacobian_gain(lambda x: x @ gapped.T, start, start)
    assert few <= 3.0 * (1 + 1e-6) and few == pytest.approx(3.0, rel=0.05)
    assert jacobian_gain(lambda x: x @ a.T, start, torch.zeros_like(start)) == (0.0, 0.0)


@pytest.mark.parametrize("residual", ["deeploop", "preln"])
def test_phi_jacobian_matches_finite_differences(residual) -> None:
    model = model_of(seed=2, residual=residual)
    with torch.no_grad():
        tokens = WINDOW[:, :-1]
        rope = model.rope(tokens)
        x, ctx = model.core.start(model.source(tokens, rope), rope=rope)
        d0 = model.core.deviation(x, ctx)
        got = phi_jacobian(model.core, ctx, d0, sequences=2)
        h, d, eps = ctx["anchor"][:2], d0[:2].double(), 1e-3
        model.double()
        ctx2 = {k: v[:2].double() if k in ("source", "anchor") else v for k, v in ctx.items()}
        jd = (model.core.phi_ctx(h.double() + eps * d, ctx2)
              - model.core.phi_ctx(h.double() - eps * d, ctx2)) / (2 * eps)
    assert got["jacobian_gain_D0"] == pytest.approx(float(jd.norm() / d.norm()), rel=1e-4)
    assert got["jacobian_norm"] >= got["jacobian_gain_D0"] * (1 - 1e-6)


@pytest.mark.parametrize("residual", ["deeploop", "deepnorm", "preln"])
def test_sublayer_ratios_equal_a_direct_computation(residual) -> None:
    model = model_of(seed=1, residual=residual, n_core=2)
    norm = lambda x: float(x.norm(dim=-1).mean())  # noqa: E731
    with torch.no_grad():
        tokens = WINDOW[:, :-1]
        rope = model.rope(tokens)
        _, ctx = model.core.start(model.source(tokens, rope), rope=rope)
        got = sublayer_ratios(model.core, ctx, ctx["anchor"])
        h = ctx["anchor"]
        for i in range(2):
            block = model.core.blocks[i]
            if residual == "preln":
                attn = block.attn(block.norm1(h), rope)
                want_attn = norm(attn) / norm(h)
                h1 = h + attn
                mlp = block.mlp(block.norm2(h1))
                want_mlp, h = norm(mlp) / norm(h1), h1 + mlp
            else:
                attn = block.attn(h, rope)
                want_attn = norm(attn) / norm(block.alpha * h)
                h1 = block.norm1(block.alpha * h + attn)
                mlp = block.mlp(h1)
                want_mlp, h = norm(mlp) / norm(block.alpha * h1), \
                    block.norm2(block.alpha * h1 + mlp)
            assert got[f"branch_attn_b{i}"] == pytest.approx(want_attn, rel=1e-4)
            assert got[f"branch_mlp_b{i}"] == pytest.approx(want_mlp, rel=1e-4)
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.modules())
    if residual == "deeploop":  # xavier gain beta = (8N)^-1/2: branches start far below alpha*h
        assert max(got.values()) < 0.05


def test_loop_diagnostics_row_has_the_probes() -> None:
    diag = loop_diagnostics(model_of(), WINDOW, depth=3)
    # at init the Post-LN core is near a normaliser with R = rho: the top gain is ~1, and along
    # D_0 (cos(D_0, h*) ~ -0.7) the radial part is removed
    assert diag["diag/jacobian_norm"] == pytest.approx(1.0, abs=0.05)
    assert diag["diag/jacobian_gain_D0"] < diag["diag/jacobian_norm"]
    assert {"diag/branch_attn_b0", "diag/branch_mlp_b0"} <= set(diag)
    looped = loop_diagnostics(model_of(recurrence="looped"), WINDOW, depth=3)
    assert "diag/jacobian_gain_D0" not in looped and looped["diag/jacobian_norm"] > 0
