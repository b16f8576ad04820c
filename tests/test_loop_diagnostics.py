"""Loop diagnostics (scse_dist.train.diagnostics): exact values on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.param_groups import SHARE_GROUPS, share_group_of
from scse_dist.train.callbacks.diagnostics import LoopDiagnosticsCallback
from scse_dist.train.config import TrainConfig
from scse_dist.train.depth_config import DepthSamplingConfig
from scse_dist.train.diagnostics import gradient_shares, loop_diagnostics
from scse_dist.train.metrics import format_line


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=3),
                          **kw})


def model_of(seed: int = 0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(tiny(**kw)).eval()


WINDOW = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))


def test_zero_deviation_start_stays_at_the_anchor() -> None:
    model = model_of(anchor_scale="free")  # core_norm would normalise h* = Q s = s away from H0
    with torch.no_grad():  # Q = I: h* = s = H0, so D_0 = 0 and the mask keeps it there
        model.core.anchor.weight.copy_(torch.eye(32))
    diag = loop_diagnostics(model, WINDOW, depth=3, max_depth=5)
    assert [diag[f"diag/D_norm_t{t}"] for t in range(6)] == [0.0] * 6
    assert [diag[f"diag/D_ratio_t{t}"] for t in range(5)] == [0.0] * 5
    assert diag["diag/cos_D0_anchor"] == diag["diag/cos_DT_anchor"] == 0.0
    # every depth reads out h*: the loop is worth exactly nothing
    assert diag["diag/loss_t1"] == diag["diag/loss_tT"] and diag["diag/loop_gain"] == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_deeploop_init_is_neutral(seed: int) -> None:
    """At init the Post-LN core outputs norm sqrt(d) per token (unit gains), the orthogonal
    anchor keeps the source's norm sqrt(d): R = rho, and the loop neither grows nor shrinks D."""
    diag = loop_diagnostics(model_of(seed), WINDOW, depth=3, max_depth=8)
    root_d = math.sqrt(32)
    assert diag["diag/core_scale"] == pytest.approx(root_d, rel=1e-6)
    for key in ("anchor_norm", "source_norm", "response_norm"):
        assert diag[f"diag/{key}"] == pytest.approx(root_d, rel=1e-5)
    assert diag["diag/anchor_over_scale"] == pytest.approx(1.0, abs=1e-5)
    # D_0 = s - Q s with Q s orthogonal to s in high dimension: |D_0| ~ sqrt(2d), cos ~ -1/sqrt 2
    assert diag["diag/D_norm_t0"] == pytest.approx(math.sqrt(2) * root_d, rel=0.1)
    assert diag["diag/cos_D0_anchor"] == pytest.approx(-2 ** -0.5, abs=0.1)
    for t in range(8):
        assert diag[f"diag/D_ratio_t{t}"] == pytest.approx(1.0, abs=2e-3)


def test_values_agree_with_the_model_forward() -> None:
    model = model_of(seed=3)
    diag = loop_diagnostics(model, WINDOW, depth=3, max_depth=6)
    tokens, targets = WINDOW[:, :-1], WINDOW[:, 1:]
    with torch.no_grad():
        out = model(tokens, targets, depth=6, readout_depths=[1, 3], keep_logits=False)
        s = model.source(tokens)
        h = [model.core.initial_state(s), *model.core(s, 6, readout_depths=range(1, 7))]
    deviation = [float((x - model.core.anchor_of(s)).norm(dim=-1).mean()) for x in h]
    assert [diag[f"diag/D_norm_t{t}"] for t in range(7)] == pytest.approx(deviation, rel=1e-6)
    assert diag["diag/D_ratio_t2"] == pytest.approx(deviation[3] / deviation[2], rel=1e-6)
    assert diag["diag/loss_t1"] == pytest.approx(float(out.loss_by_depth[1]), rel=1e-6)
    assert diag["diag/loss_tT"] == pytest.approx(float(out.loss_by_depth[3]), rel=1e-6)
    assert diag["diag/loop_gain"] == diag["diag/loss_t1"] - diag["diag/loss_tT"]


AGAINST_D0 = {"diag/D_ratio_t0", "diag/D_kept", "diag/cos_D0_anchor"}


@pytest.mark.parametrize("recurrence", ["looped", "additive"])
def test_other_recurrences_measure_from_the_source(recurrence) -> None:
    diag = loop_diagnostics(model_of(recurrence=recurrence), WINDOW, depth=3)
    # they start at H0 = s, the reference point: D_0 = 0, then the loop moves off it
    assert diag["diag/D_norm_t0"] == 0.0 and diag["diag/D_norm_t1"] > 0
    # what is measured against D_0 would be inf, inf and 0 by construction: not logged
    assert AGAINST_D0.isdisjoint(diag) and "diag/D_ratio_t1" in diag
    assert diag["diag/anchor_norm"] == diag["diag/source_norm"]
    assert "D_T/D_0" not in format_line({"step": 5, **diag})
    # from zeros D_0 = -s: defined, and logged
    zeros = loop_diagnostics(model_of(recurrence=recurrence, init_state="zeros", inject="add"),
                             WINDOW, depth=3)
    assert AGAINST_D0 <= set(zeros) and math.isfinite(zeros["diag/D_kept"])
    assert loop_diagnostics(model_of(recurrence="untied"), WINDOW, depth=3) == {}


@pytest.mark.parametrize("fields, starts", [
    (dict(recurrence="looped"), True), (dict(recurrence="additive"), True),
    (dict(recurrence="looped", init_state="random", inject="add"), False),
    (dict(recurrence="scse"), False),  # learned anchor, source start
    (dict(recurrence="scse", anchor="source", forcing_bias_scale=0.5, zero_mask=False), True),
    (dict(recurrence="scse", anchor="zero", init_state="zeros", inject="add",
          forcing_bias_scale=0.5, zero_mask=False), True),
])
def test_the_transition_says_whether_the_loop_starts_at_its_anchor(fields, starts) -> None:
    from scse_dist.model.transitions import check_model_config

    assert check_model_config(tiny(**fields)).starts_at_anchor is starts
    diag = loop_diagnostics(model_of(**fields), WINDOW, depth=3)
    assert AGAINST_D0.isdisjoint(diag) if starts else AGAINST_D0 <= set(diag)
    # an SCSE start that happens to sit at the anchor is measured: 0/0 reads 0, not undefined
    if not starts and fields["recurrence"] == "scse":
        assert math.isfinite(diag["diag/D_kept"])


def test_preln_has_no_core_scale() -> None:
    diag = loop_diagnostics(model_of(residual="preln"), WINDOW, depth=2)
    assert "diag/core_scale" not in diag and "diag/anchor_over_scale" not in diag
    assert diag["diag/response_norm"] > 0


def test_diagnostics_leave_the_rng_alone() -> None:
    model = model_of(init_state="random", anchor="learned")
    before = torch.random.get_rng_state()
    loop_diagnostics(model, WINDOW, depth=2)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_gradient_shares_are_exact() -> None:
    model = model_of()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.core.anchor.weight.grad.fill_(1.0)  # 32*32 = 1024
    model.prelude[0].norm1.weight.grad.fill_(2.0)  # 32 * 4 = 128
    model.norm.weight.grad.fill_(1.0)  # coda: 32
    model.core.blocks[0].norm2.weight.grad = None  # a parameter without grad counts nothing
    shares = gradient_shares(model)
    total = 1024 + 128 + 32
    assert shares["diag/grad_norm"] == pytest.approx(math.sqrt(total))
    assert shares["diag/grad_share_anchor"] == pytest.approx(1024 / total)
    assert shares["diag/grad_share_prelude"] == pytest.approx(128 / total)
    assert shares["diag/grad_share_coda"] == pytest.approx(32 / total)
    assert shares["diag/grad_share_core"] == shares["diag/grad_share_embed"] == 0.0
    assert {share_group_of(n) for n, _ in model.named_parameters()} == set(SHARE_GROUPS)


def test_share_groups_are_where_a_parameter_sits() -> None:
    """The gradient shares' groups, derived from param_groups.group_of: a norm gain goes with its
    part, an untied head and the final norm with the coda, the concat adapter with the core."""
    model = model_of(tie_embeddings=False, qk_norm=True, inject="concat")
    got = {n: share_group_of(n) for n, _ in model.named_parameters()}
    assert got["core.anchor.weight"] == "anchor" and got["core.adapter.weight"] == "core"
    assert got["core.blocks.0.norm2.weight"] == got["core.blocks.0.attn.q_norm.weight"] == "core"
    assert got["prelude.0.norm1.weight"] == got["prelude.0.mlp.up.weight"] == "prelude"
    assert got["norm.weight"] == got["head.weight"] == got["coda.0.norm1.weight"] == "coda"
    assert got["embed.weight"] == "embed"


def fake_state(model, step: int, zero_stage: int = 0, cfg=None):
    from types import SimpleNamespace

    engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: zero_stage)
    return SimpleNamespace(engine=engine, step=step, rank0=True, cfg=cfg, metrics_extra={},
                           step_seconds=0.0)


FIVE = LoopDiagnosticsCallback.Config(every_steps=5)
# training depths 2..4 (uniform, max 4) around model.depth 3
UP_TO_4 = TrainConfig(depth=DepthSamplingConfig(kind="uniform", max=4))


def test_callback_logs_on_its_steps_only() -> None:
    model = model_of()
    loss = model(WINDOW[:, :-1], WINDOW[:, 1:], keep_logits=False).loss
    loss.backward()

    def row_of(callback, step: int, zero_stage: int = 0) -> dict:
        callback.on_start(fake_state(model, 0, zero_stage))
        callback.before_update(fake_state(model, step - 1))  # state.step: the steps done before
        state = fake_state(model, step)
        callback.on_step_end(state)
        return state.metrics_extra

    callback = LoopDiagnosticsCallback(FIVE, UP_TO_4, tiny(), window=WINDOW)
    assert (callback.depth, callback.max_depth) == (3, 4)
    assert row_of(callback, 4) == {}
    row = row_of(callback, 5)
    assert row["diag/grad_norm"] > 0 and row["diag/D_norm_t4"] > 0
    assert sum(row[f"diag/grad_share_{g}"] for g in SHARE_GROUPS) == pytest.approx(1.0)
    assert model.training is False  # left as it was
    skipped = LoopDiagnosticsCallback(FIVE, UP_TO_4, tiny(), window=WINDOW)
    assert row_of(skipped, 5, zero_stage=3) == {}


def test_the_callback_from_a_run_config(tmp_path, capsys) -> None:
    from scse_dist.config import load_config

    data = f"data.path={tmp_path / 'none'}"
    cfg = load_config(None, [data, "train.log_every=7", "train.depth.kind=uniform",
                             "model.depth=3"])
    # null: log_every
    callback = LoopDiagnosticsCallback(LoopDiagnosticsCallback.Config(), cfg.train, cfg.model)
    assert callback.for_run()
    assert (callback.every, callback.depth, callback.max_depth) == (7, 3, 6)
    callback.on_start(fake_state(None, 0, cfg=cfg))
    assert callback.window is None  # no held-out split there: said in one line, grads still run
    assert capsys.readouterr().out.startswith(f"loop diagnostics: no held-out batch in {tmp_path}")
    assert callback.due(14) and not callback.due(15)
    every_5 = LoopDiagnosticsCallback(FIVE, cfg.train, cfg.model)
    assert every_5.for_run() and every_5.every == 5
    off = LoopDiagnosticsCallback.Config(every_steps=0)
    assert not LoopDiagnosticsCallback(off, cfg.train, cfg.model).for_run()
    untied = load_config(None, [data, "model.recurrence=untied", "model.residual=preln"])
    assert not LoopDiagnosticsCallback(FIVE, untied.train, untied.model).for_run()
