"""model.branch_scale (issue 26): forward holds the matrices DeepNet initialises at gain beta
(value, output, FFN) at gain 1 and multiplies their outputs by beta in the forward. The same
function at init (same seed), gradients wrt those matrices scaled by beta, so one AdamW step
moves the branch beta times as far; for scse and the baselines alike, Post-LN only; off (init)
computes the Post-LN block as written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scse_dist.model import Block, LoopedLM
from scse_dist.model.blocks import rope_tables
from scse_dist.model.config import ModelConfig

BETA_MATRICES = ("attn.proj.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_heads=2, ffn_hidden=64,
                                 max_seq_len=32, depth=3), **kw})


def model_of(**kw) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(tiny(**kw))


WINDOW = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
TOKENS, TARGETS = WINDOW[:, :-1], WINDOW[:, 1:]
KINDS = [dict(recurrence="scse"), dict(recurrence="additive"), dict(recurrence="untied"),
         dict(recurrence="scse", residual="deepnorm"), dict(recurrence="looped", n_core=2)]


def _value_rows(name: str, w: torch.Tensor, d: int = 32) -> torch.Tensor:
    """The value rows of a qkv weight (the only beta-gain part of it), else w."""
    return w[2 * d:] if name.endswith("attn.qkv.weight") else w


def _is_beta_matrix(name: str) -> bool:
    return name.endswith(BETA_MATRICES + ("attn.qkv.weight",))


def test_default_is_init_and_the_block_computes_post_ln_as_written() -> None:
    assert ModelConfig().branch_scale == "init"
    block = Block(tiny())
    assert block.attn.scale is None and block.mlp.scale is None
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    rope = rope_tables(8, block.cfg, h.device)
    h1 = block.norm1(block.alpha * h + block.attn(h, rope))
    mlp = block.mlp.down(F.silu(block.mlp.gate(h1)) * block.mlp.up(h1))
    assert torch.equal(block(h, rope), block.norm2(block.alpha * h1 + mlp))


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_forward_is_the_same_function_at_init_with_gain_one_weights(kw: dict) -> None:
    init, fwd = model_of(**kw), model_of(branch_scale="forward", **kw)
    beta = fwd.core.blocks[0].beta
    assert beta < 0.5 and fwd.core.blocks[0].attn.scale == beta
    a, b = init.state_dict(), fwd.state_dict()
    n_beta = 0
    for name in a:
        if _is_beta_matrix(name):
            n_beta += 1
            assert torch.allclose(_value_rows(name, a[name]), beta * _value_rows(name, b[name]),
                                  rtol=1e-6, atol=0), name
            # query and key rows keep gain 1 in both
            if name.endswith("qkv.weight"):
                assert torch.equal(a[name][:64], b[name][:64]), name
        else:
            assert torch.equal(a[name], b[name]), name
    assert n_beta == 5 * (len(init.prelude) + len(init.core.blocks) + len(init.coda))
    with torch.no_grad():
        diff = (init(TOKENS).logits - fwd(TOKENS).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("kw", KINDS[:3], ids=lambda kw: kw["recurrence"])
def test_gradients_wrt_the_beta_matrices_are_scaled_by_beta(kw: dict) -> None:
    init, fwd = model_of(**kw), model_of(branch_scale="forward", **kw)
    beta = fwd.core.blocks[0].beta
    init(TOKENS, TARGETS).loss.backward()
    fwd(TOKENS, TARGETS).loss.backward()
    grads = dict(fwd.named_parameters())
    for name, p in init.named_parameters():
        g_init, g_fwd = p.grad, grads[name].grad
        scale = 1.0
        if _is_beta_matrix(name):
            if name.endswith("qkv.weight"):  # q, k rows: unchanged; value rows: beta
                assert torch.allclose(g_fwd[:64], g_init[:64], rtol=1e-3, atol=1e-7), name
            g_init, g_fwd, scale = _value_rows(name, g_init), _value_rows(name, g_fwd), beta
        err = (g_fwd - scale * g_init).abs().max().item()
        assert err <= 1e-3 * g_init.abs().max().item() * scale + 1e-8, (name, err)


def test_one_adamw_step_moves_the_branch_beta_times_as_far() -> None:
    moved = {}
    for mode in ("init", "forward"):
        model = model_of(branch_scale=mode)
        before = model.core.blocks[0].mlp.down.weight.detach().clone()
        # eps ~ 0: the first step is lr * sign(g) whatever the gradient's scale
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, eps=1e-30)
        model(TOKENS, TARGETS).loss.backward()
        opt.step()
        change = model.core.blocks[0].mlp.down.weight.detach() - before
        # the matrix the branch computes with: W (init) or beta * W (forward)
        moved[mode] = change * (model.core.blocks[0].beta if mode == "forward" else 1.0)
    beta = model.core.blocks[0].beta
    ratio = moved["forward"].norm() / moved["init"].norm()
    assert ratio.item() == pytest.approx(beta, rel=1e-5)


def test_forward_needs_a_post_ln_residual() -> None:
    with pytest.raises(ValueError, match=r"^model.branch_scale: forward moves deepnorm/"
                                          r"deeploop's beta into the forward; residual=preln"):
        LoopedLM(tiny(residual="preln", branch_scale="forward"))


@pytest.mark.parametrize("residual, same_as", [("deeploop", "forward"), ("deepnorm", "forward"),
                                               ("preln", "init")])
def test_auto_is_forward_under_post_ln_and_init_under_preln(residual: str, same_as: str) -> None:
    auto, named = model_of(residual=residual, branch_scale="auto"), \
        model_of(residual=residual, branch_scale=same_as)
    assert auto.core.blocks[0].attn.scale == named.core.blocks[0].attn.scale
    a, b = auto.state_dict(), named.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(auto(TOKENS).logits, named(TOKENS).logits)
