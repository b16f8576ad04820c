"""Interventions against SCSE's loop collapse (issue 17), each one ModelConfig field, default off:
anchor_scale, loop_stability, residual_depth."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scse_dist.model import LoopedLM, residual_constants
from scse_dist.model.config import ModelConfig
from scse_dist.model.recurrence import stability_penalty
from scse_dist.model.transitions import transition_for
from scse_dist.train.diagnostics import loop_diagnostics


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=3),
                          **kw})


def model_of(seed: int = 0, **kw) -> LoopedLM:
    torch.manual_seed(seed)
    return LoopedLM(tiny(**kw))


WINDOW = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
TOKENS, TARGETS = WINDOW[:, :-1], WINDOW[:, 1:]


# ------------------------------------------------------------------ defaults: SCSE as it was


def reference_scse_loss(model: LoopedLM, depth: int) -> torch.Tensor:
    """The SCSE recurrence written out: h* = Q s, r* = Phi(h*), D_0 = s - h*,
    D_{t+1} = m(D_t) * (Phi(h* + D_t) - r*), loss of the read-out of h* + D_T."""
    core = model.core
    s = model.source(TOKENS)
    anchor = s @ core.anchor.weight.t()
    response = core.phi(anchor, s)
    d = s - anchor
    for _ in range(depth):
        d = (core.phi(anchor + d, s) - response) * (d != 0).any(-1, keepdim=True).to(d.dtype)
    logits = model.readout(anchor + d)
    return F.cross_entropy(logits.float().flatten(0, 1), TARGETS.flatten())


def test_free_anchor_computes_scse_as_written() -> None:
    model = model_of(anchor_scale="free")
    out = model(TOKENS, TARGETS, depth=3)
    assert out.aux_loss is None
    assert torch.equal(out.loss, reference_scse_loss(model, 3))
    # residual_depth equal to depth is the default's N; 0 means exactly that
    for name, a in model.state_dict().items():
        assert torch.equal(a, model_of(residual_depth=3).state_dict()[name]), name


# ------------------------------------------------------------------ anchor_scale


def test_core_norm_anchor_tracks_the_core_scale() -> None:
    free, tied = model_of(anchor_scale="free"), model_of(anchor_scale="core_norm")
    for model in (free, tied):
        with torch.no_grad():
            model.core.anchor.weight.mul_(3.0)  # R drifts to 3 rho ...
            model.core.blocks[0].norm2.weight.fill_(0.5)  # ... while rho halves
    ratio_free = loop_diagnostics(free.eval(), WINDOW, 3)["diag/anchor_over_scale"]
    ratio_tied = loop_diagnostics(tied.eval(), WINDOW, 3)["diag/anchor_over_scale"]
    assert ratio_free == pytest.approx(3.0 / 0.5, rel=1e-5)
    assert ratio_tied == pytest.approx(1.0, abs=1e-5)  # uniform gain: exactly rho per token


def test_core_norm_anchor_trains_the_norm_gain_through_the_anchor() -> None:
    model = model_of(anchor_scale="core_norm", depth=1)
    model(TOKENS, TARGETS, depth=1).loss.backward()
    assert model.core.blocks[0].norm2.weight.grad.abs().sum() > 0
    assert model.core.anchor.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kw,message", [
    (dict(anchor_scale="core_norm", recurrence="additive"),
     "model.anchor_scale: only scse has an anchor; got anchor_scale=core_norm with "
     "recurrence=additive"),
    (dict(anchor_scale="core_norm", residual="preln"),
     "model.anchor_scale: core_norm needs a Post-LN residual (deepnorm or deeploop), whose core "
     "output is normalised; got residual=preln"),
    (dict(anchor_scale="core_norm", anchor="zero", init_state="source"),
     "model.anchor_scale: core_norm would normalise the zero anchor (RMSNorm at 0); use anchor "
     "learned or source"),
    (dict(loop_stability=0.1, recurrence="untied"),
     "model.loop_stability: untied has no loop to keep moving; set it to 0"),
    (dict(loop_stability=-1.0), "model.loop_stability: must be >= 0, got -1.0"),
    (dict(residual_depth=-2), "model.residual_depth: must be >= 0 (0: model.depth), got -2"),
])
def test_bad_intervention_fields_are_one_line(kw: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:  # the model's own check: a plain ValueError
        LoopedLM(tiny(**kw))
    assert str(err.value) == message


# ------------------------------------------------------------------ loop_stability


def rows(*norms_and_dirs) -> torch.Tensor:
    """(1, n, 2) deviations from (norm, angle) pairs."""
    return torch.tensor([[[n * math.cos(a), n * math.sin(a)] for n, a in norms_and_dirs]])


def test_stability_penalty_by_hand() -> None:
    d_first = rows((2.0, 0.0), (1.0, 0.0), (0.0, 0.0))  # the third token starts at its anchor
    d_before = rows((1.0, 0.0), (1.0, 0.0), (0.0, 0.0))
    d_last = rows((0.5, 0.0), (1.0, math.pi / 2), (0.0, 0.0))
    # hinge over the 2 moving tokens: (0.5 - 0.25)_+ and (0.5 - 1)_+ = 0 -> 0.125
    # late motion over 3 tokens: 0.5/0.5, sqrt(2)/1, 0 -> (1 + sqrt 2) / 3
    want = 0.125 + (1 + math.sqrt(2)) / 3
    assert float(stability_penalty(d_first, d_before, d_last)) == pytest.approx(want, rel=1e-6)


def test_loop_stability_is_a_training_term_only() -> None:
    model = model_of(loop_stability=0.5)
    out = model(TOKENS, TARGETS, depth=3)
    core = model.core
    with torch.no_grad():
        x, ctx = core.start(model.source(TOKENS))
        devs = [core.deviation(x, ctx)]
        for t in range(3):
            x = core.step(x, ctx, t)
            devs.append(core.deviation(x, ctx))
    want = 0.5 * stability_penalty(devs[0], devs[2], devs[3])
    assert float(out.aux_loss.detach()) == pytest.approx(float(want), rel=1e-6)
    assert torch.equal(out.loss, model_of()(TOKENS, TARGETS, depth=3).loss)  # the LM loss as before
    with torch.no_grad():
        assert model(TOKENS, TARGETS, depth=3).aux_loss is None  # evaluation: no term
    assert model(TOKENS, depth=3).aux_loss is None  # no targets: no term


def test_loop_stability_gradient_is_finite_at_the_anchor() -> None:
    model = model_of(loop_stability=1.0, anchor_scale="free")
    with torch.no_grad():  # D_0 = 0 everywhere: the mask holds every row at the anchor
        model.core.anchor.weight.copy_(torch.eye(32))
    out = model(TOKENS, TARGETS, depth=3)
    assert float(out.aux_loss) == 0.0
    (out.loss + out.aux_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_loop_stability_pushes_a_collapsing_loop_outward() -> None:
    """A step against the term's gradient alone raises |D_T| / |D_0| on a loop made to contract
    (the anchor scaled to 2 rho, the collapse direction of issue 17)."""
    model = model_of(loop_stability=1.0, anchor_scale="free")
    with torch.no_grad():
        model.core.anchor.weight.mul_(2.0)
    before = loop_diagnostics(model.eval(), WINDOW, 3)
    model(TOKENS, TARGETS, depth=3).aux_loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    after = loop_diagnostics(model, WINDOW, 3)
    kept = lambda d: d["diag/D_norm_t3"] / d["diag/D_norm_t0"]  # noqa: E731
    assert kept(before) < 0.5 and kept(after) > kept(before)


# ------------------------------------------------------------------ residual_depth


@pytest.mark.parametrize("kw,n", [(dict(), 1 + 3 + 1), (dict(residual_depth=8), 1 + 8 + 1),
                                  (dict(residual_depth=8, n_core=2), 1 + 16 + 1)])
def test_residual_constants_from_residual_depth(kw: dict, n: int) -> None:
    assert residual_constants(transition_for(tiny(**kw))) == ((2 * n) ** 0.5, (8 * n) ** -0.5)
    alpha = LoopedLM(tiny(**kw)).core.blocks[0].alpha
    assert alpha == (2 * n) ** 0.5


def test_residual_depth_sets_preln_init_too() -> None:
    torch.manual_seed(0)
    proj = LoopedLM(tiny(residual="preln", residual_depth=48, d_model=64)).core.blocks[0].attn.proj
    # GPT-2 init: std 0.02 / sqrt(2N), N = 1 + 48 + 1
    assert float(proj.weight.std()) == pytest.approx(0.02 / math.sqrt(100), rel=0.05)


# ------------------------------------------------------------------ the default (issue 17's study)


@pytest.mark.parametrize("kw, want", [
    ({}, "core_norm"), ({"residual": "deepnorm"}, "core_norm"), ({"residual": "preln"}, "free"),
    ({"anchor": "source", "init_state": "zeros"}, "free"),
    ({"anchor": "zero", "init_state": "random", "inject": "add"}, "free"),
    ({"recurrence": "additive"}, "free"), ({"recurrence": "looped"}, "free")])
def test_auto_anchor_scale_is_core_norm_where_it_applies(kw, want) -> None:
    from scse_dist.config import config_from_dict
    from scse_dist.model.transitions import resolved_anchor_scale

    assert tiny().anchor_scale == "free"  # the default: SCSE as it was
    kw = {"anchor_scale": "auto", **kw}
    assert resolved_anchor_scale(tiny(**kw)) == want
    # a run config names what ran: auto is written down resolved
    model = {"vocab_size": 64, "d_model": 32, "n_heads": 2, "max_seq_len": 32, **kw}
    run = config_from_dict({"model": model, "data": {"seq_len": 32}})
    assert run.model.anchor_scale == want


def test_a_saved_config_without_anchor_scale_ran_free(tmp_path) -> None:
    """A run saved before the field existed trained free SCSE: loading its config must not turn
    the default on under its weights (the HF config's default for a config.json without the
    field is free too: configuration_scse.MODEL_FIELDS)."""
    import yaml

    from scse_dist.config import load_config, load_saved_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"vocab_size": 64, "d_model": 32, "n_heads": 2,
                                              "max_seq_len": 32}, "data": {"seq_len": 32}}))
    assert load_saved_config(path).model.anchor_scale == "free"
    assert load_config(path).model.anchor_scale == "free"  # today's default too
