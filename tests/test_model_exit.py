"""Adaptive depth per token, teacher-forced and batched (LoopedLM.forward(exit_rule=...)).

A token that exits keeps its state, and the other tokens' later steps attend to its latest K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from recurrences import over_recurrences
from scse_dist.model import ExitRule, LoopedLM, parse_exit_rule
from scse_dist.model.config import ModelConfig
from scse_dist.model.kv_cache import LoopKV

# each loop of the registry as configured by default, and with concat injection under Pre-LN
VARIANTS = [dict(), dict(inject="concat", residual="preln")]


def tiny(**kw) -> LoopedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=64, n_prelude=1,
                      n_core=2, n_coda=1, depth=4, **kw)
    return LoopedLM(cfg).eval()


def tokens(b: int = 3, s: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(1))


@over_recurrences(loops_only=True)
@pytest.mark.parametrize("kw", VARIANTS,
                         ids=lambda kw: "-".join(map(str, kw.values())) or "default")
def test_rules_that_never_exit_early_equal_the_plain_forward(recurrence: str, kw: dict) -> None:
    model, x = tiny(recurrence=recurrence, **kw), tokens()
    with torch.no_grad():
        plain = model(x, depth=6).logits
        for rule in ("fixed,max=6", "motion:0,max=6", "kl:0,max=6"):
            out = model(x, exit_rule=parse_exit_rule(rule))
            assert torch.equal(out.logits, plain), rule
            assert out.steps_used.tolist() == [[6] * 16] * 3 and out.depth == 6
        # max_steps unset: the depth argument is the cap
        assert torch.equal(model(x, depth=6, exit_rule=ExitRule("fixed")).logits, plain)


def test_untied_runs_at_its_fixed_depth_only() -> None:
    model, x = tiny(recurrence="untied"), tokens()
    with torch.no_grad():
        assert torch.equal(model(x, exit_rule=ExitRule("fixed")).logits, model(x).logits)
        with pytest.raises(ValueError, match="fixed depth 4"):
            model(x, exit_rule=ExitRule("fixed", max_steps=6))


@over_recurrences(loops_only=True)
@pytest.mark.parametrize("kw", VARIANTS,
                         ids=lambda kw: "-".join(map(str, kw.values())) or "default")
def test_all_exiting_together_equals_the_plain_forward_at_that_depth(recurrence: str, kw: dict
                                                                      ) -> None:
    model, x = tiny(recurrence=recurrence, **kw), tokens()
    with torch.no_grad():
        for rule, depth in (("kl:1e9,min=2,max=8", 2), ("motion:1e12,min=3,max=8", 3)):
            out = model(x, exit_rule=parse_exit_rule(rule))
            assert out.steps_used.eq(depth).all(), rule
            assert torch.equal(out.logits, model(x, depth=depth).logits), rule


@dataclass(frozen=True)
class ExitAt:
    """A rule for tests: token `position` exits after `step` steps, the others at max_steps."""
    position: int
    step: int
    max_steps: int
    needs_readout = False

    def cap(self, depth: int) -> int:
        return self.max_steps

    def exited(self, step, d_prev, d_new, logp_prev=None, logp_new=None) -> torch.Tensor:
        out = torch.full(d_new.shape[:-1], step >= self.max_steps)
        out[:, self.position] |= step >= self.step
        return out


@over_recurrences(loops_only=True)
@pytest.mark.parametrize("kw", VARIANTS,
                         ids=lambda kw: "-".join(map(str, kw.values())) or "default")
def test_a_token_exiting_at_e_is_read_out_from_its_state_at_e(recurrence: str, kw: dict) -> None:
    model, x = tiny(recurrence=recurrence, **kw), tokens()
    with torch.no_grad():  # sharper attention than at init, so tokens read each other strongly
        for block in model.core.blocks:
            block.attn.qkv.weight.mul_(4)
    rope = model.rope(x)
    with torch.no_grad():
        h3, h8 = model.core(model.source(x, rope), 8, readout_depths=[3, 8], rope=rope)
        # the last token: nothing later attends to it, so its logits are those of its state at 3
        out = model(x, exit_rule=ExitAt(position=15, step=3, max_steps=8))
        expected = model.readout(torch.cat([h8[:, :15], h3[:, 15:]], dim=1), rope)
        torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-6)
        assert out.steps_used[:, 15].tolist() == [3] * 3 and out.steps_used[:, :15].eq(8).all()
        # a middle token: earlier ones are untouched, later ones see its K/V of step 1, not 8
        mid = model(x, exit_rule=ExitAt(position=7, step=1, max_steps=8))
        plain = model.readout(h8, rope)
        prefix = model(x[:, :11], exit_rule=ExitAt(position=7, step=1, max_steps=8))
    assert torch.equal(mid.logits[:, :7], plain[:, :7])
    assert (mid.logits[:, 8:] - plain[:, 8:]).abs().amax() > 1e-5  # 10x the tolerance above
    # still causal: no position reads a later token
    torch.testing.assert_close(prefix.logits, mid.logits[:, :11], rtol=0, atol=1e-6)


def test_exited_kv_keeps_the_last_active_steps_keys_and_values() -> None:
    view = LoopKV(None, tiny(recurrence="looped").core)  # no cache: only the exited tokens' K/V
    k1, v1, k2, v2 = (torch.full((1, 2, 3, 4), float(i)) for i in range(4))
    view.active = torch.tensor([[True, True, True]])
    assert view.hooks(0)[0].update(k1, v1) == (k1, v1)
    view.active = torch.tensor([[True, False, True]])  # the middle token has exited
    k, v = view.hooks(1)[0].update(k2, v2)
    assert k[0, :, :, 0].tolist() == [[2.0, 0.0, 2.0]] * 2 and \
        v[0, 0, :, 0].tolist() == [3.0, 1.0, 3.0]
    # still the step-1 keys for it, the newest for the others
    k, _ = view.hooks(2)[0].update(k2 + 5, v2)
    assert k[0, 0, :, 0].tolist() == [7.0, 0.0, 7.0]


def lively(recurrence: str) -> LoopedLM:
    """A model whose tokens settle at different depths: sharper attention and larger MLP
    updates than at init (at init every token settles in a step or two)."""
    model = tiny(recurrence=recurrence, residual="preln")
    with torch.no_grad():
        for block in model.core.blocks:
            block.attn.qkv.weight.mul_(4)
            block.mlp.down.weight.mul_(10)
    return model


@pytest.mark.parametrize("recurrence, rule", [
    ("looped", "motion:0.3,max=12"), ("scse", "motion:0.3,max=12"),
    ("looped", "kl:1e-4,max=12"), ("scse", "kl:1e-4,min=2,max=12")])
def test_batched_exit_decisions_equal_batch_size_one(recurrence: str, rule: str) -> None:
    model, x = lively(recurrence), tokens(4, 16)
    with torch.no_grad():
        batched = model(x, exit_rule=parse_exit_rule(rule))
        alone = [model(x[i:i + 1], exit_rule=parse_exit_rule(rule)) for i in range(4)]
    steps = batched.steps_used
    assert 2 < steps.float().mean() < 10 and steps.max() - steps.min() >= 2  # the rule decides
    assert torch.equal(torch.cat([a.steps_used for a in alone]), steps)
    torch.testing.assert_close(torch.cat([a.logits for a in alone]), batched.logits,
                               rtol=0, atol=1e-5)


def test_exit_rule_refuses_what_it_cannot_read_out() -> None:
    model, x = tiny(recurrence="scse"), tokens()
    with pytest.raises(ValueError, match="readout_depths"):
        model(x, readout_depths=[1, 2], exit_rule=ExitRule("fixed"))


def test_left_padded_batch_exits_as_each_sequence_alone() -> None:
    model = lively("scse")
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (16, 9, 4)]
    x = torch.full((3, 16), 5)
    mask = torch.zeros(3, 16, dtype=torch.long)
    for i, q in enumerate(seqs):
        x[i, 16 - len(q):], mask[i, 16 - len(q):] = q, 1
    rule = parse_exit_rule("motion:0.3,max=12")
    with torch.no_grad():
        batched = model(x, attention_mask=mask, exit_rule=rule)
        for i, q in enumerate(seqs):
            alone = model(q[None], exit_rule=rule)
            assert torch.equal(batched.steps_used[i, 16 - len(q):], alone.steps_used[0])
            torch.testing.assert_close(batched.logits[i, 16 - len(q):], alone.logits[0],
                                       rtol=0, atol=1e-5)
