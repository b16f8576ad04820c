"""train.optimizer.update_clip (StableAdamW's update clipping, scse_dist.train.update_clip): each
tensor's AdamW step divided by max(1, RMS(g / sqrt(v_hat)) / update_clip). Against a direct
computation of the clipped AdamW, per tensor; exactly AdamW when no tensor clips; a flat tensor with
a layout (ZeRO-1/2's partition) gives each parameter its own factor; the config's refusals; and on
real ranks ZeRO-0/1/2 at 1 and 2 ranks agree (the factor of a parameter split between ranks is
all-reduced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scse_dist.config import load_config
from scse_dist.model import LoopedLM
from scse_dist.train.engine import build_optimizer
from scse_dist.train.update_clip import Layout, UpdateClippedAdamW
from scse_dist.typed_yaml import ConfigError
from train_procs import all_passed, run_ranks

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SHAPES = [(4, 6), (5,), (3, 2, 2)]


def gradients(steps: int = 6) -> list[list[torch.Tensor]]:
    """Small gradients, then a spike at step 4 in the first tensor only (which must clip there)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        grads = [torch.randn(s, generator=g) * 0.01 for s in SHAPES]
        if step == 3:
            grads[0] = grads[0] * 100
        out.append(grads)
    return out


def reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]], clip: float):
    """AdamW written out, each tensor's step divided by max(1, RMS / clip); the factors."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    factors = []
    for t, step_grads in enumerate(grads, start=1):
        row = []
        for i, g in enumerate(step_grads):
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            m_hat, v_hat = m[i] / (1 - BETAS[0] ** t), v[i] / (1 - BETAS[1] ** t)
            rms = (g * g / v_hat.clamp(min=EPS ** 2)).mean().sqrt().item()
            factor = max(1.0, rms / clip)
            row.append(factor)
            params[i] = params[i] - LR / factor * (WD * params[i] + m_hat / (v_hat.sqrt() + EPS))
        factors.append(row)
    return params, factors


def run(opt_of, params: list[torch.Tensor], grads: list[list[torch.Tensor]]):
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_of(params)
    factors = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        factors.append([f.item() for f in getattr(opt, "last_factors", [])])
    return [p.detach() for p in params], factors


def start() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("clip", [1.0, 0.5])
def test_each_tensor_s_step_is_adamw_s_divided_by_its_factor(clip: float) -> None:
    grads = gradients()
    got, got_factors = run(lambda ps: UpdateClippedAdamW(ps, update_clip=clip, lr=LR, betas=BETAS,
                                                          eps=EPS, weight_decay=WD), start(), grads)
    want, want_factors = reference(start(), grads, clip)
    flat = [f for row in want_factors for f in row]
    assert [f for row in got_factors for f in row] == pytest.approx(flat, rel=1e-5)
    # the spike clips (RMS is at most sqrt((1 - beta2^t) / (1 - beta2)), 1.92 at step 4)
    assert max(flat) > 1.5 / clip and min(flat) == 1.0
    assert want_factors[3][0] == max(flat)  # where the spike is
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-7)


def test_a_step_that_clips_nowhere_is_adamw_bit_for_bit() -> None:
    grads = gradients()
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    clipped, factors = run(lambda ps: UpdateClippedAdamW(ps, update_clip=1e9, **kw), start(), grads)
    plain, _ = run(lambda ps: torch.optim.AdamW(ps, **kw), start(), grads)
    assert {f for row in factors for f in row} == {1.0}
    for a, b in zip(clipped, plain):
        assert torch.equal(a, b)


def test_a_flat_tensor_with_a_layout_clips_each_parameter_alone() -> None:
    """ZeRO-1/2's partition: the three tensors flattened with padding between them."""
    grads, pad = gradients(), 3
    kw = dict(update_clip=1.0, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    separate, factors = run(lambda ps: UpdateClippedAdamW(ps, **kw), start(), grads)
    sizes = [torch.Size(s).numel() for s in SHAPES]
    starts = [sum(sizes[:i]) + pad * i for i in range(len(sizes))]

    def flat_of(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.cat([t.reshape(-1), torch.zeros(pad)]) for t in tensors])

    flat = torch.nn.Parameter(flat_of(start()))
    opt = UpdateClippedAdamW([flat], **kw)
    opt.layouts[id(flat)] = Layout(list(zip(starts, sizes)), sizes)
    for step, step_grads in enumerate(grads):
        flat.grad = flat_of(step_grads)
        opt.step()
        assert [f.item() for f in opt.last_factors[0]] == pytest.approx(factors[step], rel=1e-6)
    for p, s, n in zip(separate, starts, sizes):
        assert torch.allclose(flat.detach()[s:s + n], p.reshape(-1), rtol=1e-6, atol=1e-7)


def test_config_fields_and_refusals() -> None:
    cfg = load_config(None, [])
    assert cfg.train.optimizer.update_clip == 0.0
    plain = build_optimizer(cfg.train.optimizer, LoopedLM(cfg.model), on_cuda=False)
    assert type(plain) is torch.optim.AdamW
    cfg = load_config(None, ["train.optimizer.update_clip=1.0"])
    opt = build_optimizer(cfg.train.optimizer, LoopedLM(cfg.model), on_cuda=False)
    assert isinstance(opt, UpdateClippedAdamW) and opt.update_clip == 1.0
    muon = build_optimizer(load_config(None, ["train.optimizer.update_clip=1.0",
                                              "train.optimizer.kind=muon"]).train.optimizer,
                           LoopedLM(cfg.model), on_cuda=False)
    assert isinstance(muon.aux_optimizer, UpdateClippedAdamW)
    for overrides, message in [
            (["train.optimizer.update_clip=-1"],
             "train.optimizer.update_clip: must be a finite number >= 0"),
            (["train.optimizer.update_clip=nan"],
             "train.optimizer.update_clip: must be a finite number >= 0"),
            (["train.optimizer.update_clip=1", "train.optimizer.kind=deepspeed_fused_adam"],
             "train.optimizer.update_clip: DeepSpeed's FusedAdam has no per-tensor update "
             "clipping"),
            (["train.optimizer.update_clip=1", "train.engine.zero_stage=3"],
             "train.optimizer.update_clip: works at ZeRO stage 0, 1 or 2")]:
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
            load_config(None, overrides)


@pytest.mark.slow
def test_zero_0_1_2_on_two_ranks_match_one_rank(tmp_path, tiny_config, subprocess_env):
    cfg = tiny_config(tmp_path)
    overrides = ["train.batch.global_batch_size=8", "train.batch.micro_batch_size=4",
                 "train.max_steps=8",
                 "train.optimizer.lr=3e-3"]
    for world, out, stages, extra in ((1, "one", "0,1", ["train.optimizer.update_clip=0.5"]),
                                      (2, "two", "0,1,2", ["train.optimizer.update_clip=0.5"]),
                                      (1, "off", "0", [])):
        all_passed(run_ranks(["-m", "scse_dist.train.parity", "--config", cfg, "--out",
                              str(tmp_path / out), "--stages", stages, *overrides, *extra],
                             subprocess_env, world=world))
    from safetensors.torch import load_file

    def losses(d: str) -> list[float]:
        return json.loads((tmp_path / d / "losses.json").read_text())

    ref = losses("one/stage0")
    ref_params = load_file(str(tmp_path / "one" / "stage0" / "model.safetensors"))
    # the clipping acts: the run without it differs
    assert max(abs(a - b) for a, b in zip(losses("off/stage0"), ref)) > 1e-3
    for d in ("one/stage1", "two/stage0", "two/stage1", "two/stage2"):
        assert max(abs(a - b) for a, b in zip(losses(d), ref)) <= 1e-5, d
        params = load_file(str(tmp_path / Path(d) / "model.safetensors"))
        for key, want in ref_params.items():
            assert torch.allclose(params[key], want, rtol=0, atol=1e-5), (d, key)
