"""Each recurrence is one Transition held by LoopCore; the parameter names (the checkpoint and
export format) are the ones LoopCore always had."""

from __future__ import annotations

import pytest
import torch

from recurrences import over_recurrences
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import (
    TRANSITIONS,
    Additive,
    Scse,
    Transition,
    Untied,
    transition_for,
)


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=2, n_core=2, depth=3), **kw})


BLOCK = ["attn.qkv.weight", "attn.proj.weight", "mlp.gate.weight", "mlp.up.weight",
         "mlp.down.weight", "norm1.weight", "norm2.weight"]


@pytest.mark.parametrize("kw,core_blocks,extra", [
    (dict(recurrence="scse", inject="concat"), 2, ["core.anchor.weight", "core.adapter.weight"]),
    (dict(recurrence="scse", anchor="source", init_state="zeros"), 2, []),
    (dict(recurrence="looped"), 2, []),
    (dict(recurrence="additive"), 2, []),
    (dict(recurrence="untied"), 6, []),
    (dict(recurrence="untied", untied_match="params"), 2, []),
])
def test_parameter_names_are_the_checkpoint_format(kw: dict, core_blocks: int, extra: list) -> None:
    keys = set(LoopedLM(tiny(**kw)).state_dict())
    want = {"embed.weight", "norm.weight", *extra}
    for prefix, n in (("prelude", 1), ("core.blocks", core_blocks), ("coda", 1)):
        want |= {f"{prefix}.{i}.{name}" for i in range(n) for name in BLOCK}
    assert keys == want


def test_transition_facts() -> None:
    assert set(TRANSITIONS) == {"untied", "looped", "additive", "scse"}
    untied = Untied(tiny(recurrence="untied", depth=5))
    assert (untied.fixed_depth, untied.block_groups, untied.group(3)) == (5, 5, 3)
    assert not untied.revisits_blocks
    with pytest.raises(ValueError, match="fixed depth 5, got 4"):
        untied.check_depth(4)
    scse = Scse(tiny())
    assert scse.core_calls(4) == 5 and scse.learned_anchor and scse.own_flops() == 2 * 32 ** 2
    assert scse.revisits_blocks and scse.group(3) == 0 and scse.fixed_depth is None
    assert Additive(tiny(recurrence="additive")).core_calls(4) == 4
    assert Additive(tiny(recurrence="additive")).resolved_inject == "add"
    assert transition_for(tiny(recurrence="looped")).resolved_inject == "none"
    assert transition_for(tiny(recurrence="additive", inject="concat")).resolved_inject == "concat"
    # N counts every loop visit; untied runs its fixed stack, residual_depth only the constants
    assert scse.unrolled_depth == 1 + 2 * 3 + 1 and untied.unrolled_depth == 1 + 2 * 5 + 1
    deep = Scse(tiny(residual_depth=8))
    assert (deep.unrolled_depth, deep.residual_unrolled_depth) == (8, 18)


@over_recurrences()
def test_a_model_builds_its_transition_once(recurrence: str, monkeypatch) -> None:
    built = []
    init = Transition.__init__
    def counted(self, cfg):
        built.append(self)
        init(self, cfg)

    monkeypatch.setattr(Transition, "__init__", counted)
    model = LoopedLM(tiny(recurrence=recurrence, n_prelude=2, n_coda=2))
    assert len(built) == 1 and model.core.transition is built[0]
    model(torch.randint(0, 64, (1, 5)))
    assert len(built) == 1  # a forward builds none


@over_recurrences()
def test_core_steps_through_its_transition(recurrence: str) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(recurrence=recurrence)).eval()
    core = model.core
    assert type(core.transition) is TRANSITIONS[recurrence]
    toks = torch.randint(0, 64, (2, 7))
    depth = core.fixed_depth or 3
    with torch.no_grad():
        s = model.source(toks)
        x, ctx = core.start(s)
        for t in range(depth):
            x = core.step(x, ctx, t)
        assert torch.equal(core.state(x, ctx), core(s, depth)[0])
        assert torch.equal(model.readout(core.state(x, ctx)), model(toks, depth=depth).logits)
