"""bf16 autocast, on CPU as the micro-batch finder's probe runs it on CUDA: the training step, the
probe and held-out evaluation for every recurrence, anchor kind and anchor scale, under a Pre-LN
and a Post-LN residual (whose norms' fp32 weights meet the anchor map's bf16 output)."""

from __future__ import annotations

import itertools

import pytest
import torch

from recurrences import recurrences
from scse_dist.config import load_config
from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import check_model_config
from scse_dist.train import micro_batch as mb
from scse_dist.train.step import train_step
from test_train_step import RecordingEngine, windows


def _variants() -> list[dict]:
    """Every recurrence x anchor kind x anchor scale x residual the config checks accept."""
    found = []
    for recurrence, anchor, scale, residual in itertools.product(
            recurrences(), ("learned", "source", "zero"), ("free", "core_norm"),
            ("preln", "deeploop")):
        fields = dict(recurrence=recurrence, residual=residual)
        if recurrence == "scse":
            fields.update(anchor=anchor, anchor_scale=scale,
                          init_state="source" if anchor == "zero" else "zeros")
        elif (anchor, scale) != ("learned", "free"):
            continue  # the anchor fields mean nothing without one: each such model once
        try:
            check_model_config(ModelConfig(**fields))
        except ValueError:
            continue
        found.append(fields)
    return found


VARIANTS = _variants()
IDS = ["-".join(str(v) for v in fields.values()) for fields in VARIANTS]


def tiny_model(fields: dict) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32,
                                n_prelude=1, n_core=1, n_coda=1, depth=2, **fields))


def test_the_variants_include_the_learned_anchor_under_post_ln():
    assert {"recurrence": "scse", "residual": "deeploop", "anchor": "learned",
            "anchor_scale": "free", "init_state": "zeros"} in VARIANTS
    assert {fields["recurrence"] for fields in VARIANTS} == set(recurrences())


def step_and_evaluate(model: LoopedLM) -> tuple[float, dict[str, torch.Tensor], float]:
    """One training step's loss and gradients (truncated backprop where it loops), then the
    held-out loss at the same depth."""
    depth = model.fixed_depth or 3
    model.zero_grad(set_to_none=True)
    result = train_step(RecordingEngine(model), windows(2), depth=depth,
                        backprop_steps=0 if model.fixed_depth else 2)
    assert not result.skipped
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    rows = evaluate_heldout(model, windows(2), [depth])
    assert [r["depth"] for r in rows] == [depth]
    return float(result.loss_sum), grads, rows[0]["loss"]


@pytest.mark.parametrize("fields", VARIANTS, ids=IDS)
def test_training_step_and_evaluation_run_under_bf16_autocast(fields):
    model = tiny_model(fields)
    loss, grads, heldout = step_and_evaluate(model)
    with torch.autocast("cpu", torch.bfloat16):
        loss_bf16, grads_bf16, heldout_bf16 = step_and_evaluate(model)
    # the same parameters learn, in fp32, and bf16 rounding moves the losses (measured: by at
    # most 0.37%, the learned anchor under deeploop)
    assert grads_bf16.keys() == grads.keys()
    assert all(g.dtype == torch.float32 and bool(g.isfinite().all()) for g in grads_bf16.values())
    assert loss_bf16 == pytest.approx(loss, rel=0.02)
    assert heldout_bf16 == pytest.approx(heldout, rel=0.02)


@pytest.mark.parametrize("fields", VARIANTS, ids=IDS)
def test_the_finder_probe_runs_under_bf16_autocast(tiny_config, tmp_path, fields):
    # train.engine.precision=bf16: the probe runs under autocast on the run's device, CPU here
    overrides = [f"model.{k}={v}" for k, v in fields.items()]
    cfg = load_config(tiny_config(tmp_path, "train.batch.micro_batch_size=auto",
                                  "train.engine.precision=bf16", "train.batch.global_batch_size=8",
                                  "train.depth.max=3", *overrides))
    model = LoopedLM(cfg.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    model.register_forward_hook(lambda m, i, out: calls.append(torch.is_autocast_enabled("cpu")))
    mb.probe(model, 4, cfg.data, cfg.train, depth=model.fixed_depth or 3,
             device=torch.device("cpu"))
    assert calls == [True]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
