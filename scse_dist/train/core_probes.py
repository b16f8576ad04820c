"""The core's local behaviour at the anchor h* (docs/loop-diagnostics.md): how much one loop step's
map carries a deviation (`jacobian_gain`), and each core sub-layer's branch against its residual
(`sublayer_ratios`), for loop_diagnostics. Both run eagerly (compiled block math takes neither
forward-mode AD nor sub-module hooks), the Jacobian with SDPA's math kernel (forward-mode AD).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from scse_dist.model import Block, LoopCore
    from scse_dist.model.transitions import Context

JACOBIAN_ITERS = 4  # power iterations of J^T J: each one JVP and one VJP of one core call
# The Jacobian is measured on the first this many sequences: attention stays within a sequence,
# so J is block-diagonal over them, and a JVP of the whole batch would cost several core calls.
JACOBIAN_SEQUENCES = 2


@contextlib.contextmanager
def _eager_math() -> Iterator[None]:
    with torch.compiler.set_stance("force_eager"), sdpa_kernel([SDPBackend.MATH]):
        yield


def _jvp(f: Callable[[torch.Tensor], torch.Tensor], at: torch.Tensor, v: torch.Tensor
         ) -> torch.Tensor:
    """J v, forward mode (cheaper than torch.func.jvp's wrapping)."""
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(f(forward_ad.make_dual(at, v))).tangent


def jacobian_gain(f: Callable[[torch.Tensor], torch.Tensor], at: torch.Tensor,
                  start: torch.Tensor, iters: int = JACOBIAN_ITERS) -> tuple[float, float]:
    """(||J start|| / ||start||, the largest singular value of J estimated by `iters` power
    iterations of J^T J from `start`), J = df/dx at `at`, norms over the whole tensor. The second
    is ||J v|| for the unit v the iterations reach: a lower bound on the spectral norm that tightens
    with iters (exact for a start on the top singular vector). A zero start gives (0, 0)."""
    norm = float(start.float().norm())
    if norm == 0:
        return 0.0, 0.0
    with _eager_math():
        x = at.detach().requires_grad_(True)
        with torch.enable_grad():
            y = f(x)  # one graph for every VJP (J^T u); the JVPs are forward-mode, no graph
        v = (start / norm).to(at.dtype)
        along_start = gain = 0.0
        for i in range(iters + 1):
            jv = _jvp(f, at.detach(), v)
            gain = float(jv.float().norm())
            if i == 0:
                along_start = gain
            if i == iters or gain == 0:
                break
            (jtjv,) = torch.autograd.grad(y, x, jv, retain_graph=i < iters - 1)
            size = float(jtjv.float().norm())
            if size == 0:
                break
            v = jtjv / size
    return along_start, gain


def _first(ctx: Context, n: int) -> Context:
    """ctx for the first n sequences: every tensor with a batch dim (3-D and more) cut to n."""
    batch = ctx["anchor"].shape[0]
    return {k: v[:n] if isinstance(v, torch.Tensor) and v.dim() >= 3 and v.shape[0] == batch
            else v for k, v in ctx.items()}


def phi_jacobian(core: LoopCore, ctx: Context, deviation: torch.Tensor,
                 sequences: int = JACOBIAN_SEQUENCES) -> dict[str, float]:
    """{jacobian_gain_D0, jacobian_norm} of one loop step's map at the anchor: Phi's Jacobian at
    h = h* (for scse dD'/dD at D -> 0, the zero mask left out: it only freezes exact zeros; for the
    other recurrences d Phi / dh at the source), along `deviation` (D_0) and at its largest, on
    the first `sequences` sequences."""
    ctx = _first(ctx, sequences)
    along, top = jacobian_gain(lambda h: core.phi_ctx(h, ctx, 0), ctx["anchor"],
                               deviation[:sequences])
    return {"jacobian_gain_D0": along, "jacobian_norm": top}


def _mean_norm(x: torch.Tensor) -> float:
    return float(x.float().norm(dim=-1).mean())


def _block_ratios(block: Block, seen: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(attention, SwiGLU) |branch| / |residual| of one block call from the tensors its hooks saw:
    the residual term is alpha * (the sub-layer's residual input), the branch what the sum adds to
    it (sum - residual), so a multiplier on the branch is counted whatever form it takes."""
    alpha = block.alpha
    if block.post_ln:  # LN(alpha*h + G(h)): the sums are the norms' inputs
        terms = ((alpha * seen["in"], seen["norm1"]), (alpha * seen["mlp"], seen["norm2"]))
    else:  # h + G(LN(h)): the first sum is norm2's input, the second the block's output
        terms = ((seen["in"], seen["norm2"]), (seen["norm2"], seen["out"]))
    ratios = []
    for residual, total in terms:
        size = _mean_norm(residual)
        ratios.append(_mean_norm(total - residual) / size if size > 0 else float("inf"))
    return ratios[0], ratios[1]


def sublayer_ratios(core: LoopCore, ctx: Context, h: torch.Tensor) -> dict[str, float]:
    """{branch_attn_b{i}, branch_mlp_b{i}} for each core block i of one core call Phi(h): the
    mean token norm of what the sub-layer adds to its residual stream over that of the residual
    term (alpha * h under deepnorm/deeploop, h under preln). Ratios of means over tokens."""
    seen: list[dict[str, torch.Tensor]] = [{} for _ in range(core.n_core)]
    handles = []

    def keep(store: dict[str, torch.Tensor], key: str, output: bool = False) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, *out: torch.Tensor) -> None:
            store[key] = out[0] if output else args[0]
        return hook

    for i in range(core.n_core):
        block = core.blocks[i]
        handles += [block.register_forward_pre_hook(keep(seen[i], "in")),
                    block.register_forward_hook(keep(seen[i], "out", output=True)),
                    block.norm1.register_forward_pre_hook(keep(seen[i], "norm1")),
                    block.norm2.register_forward_pre_hook(keep(seen[i], "norm2")),
                    block.mlp.register_forward_pre_hook(keep(seen[i], "mlp"))]
    try:
        with torch.compiler.set_stance("force_eager"):
            core.phi_ctx(h, ctx, 0)
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for i in range(core.n_core):
        out[f"branch_attn_b{i}"], out[f"branch_mlp_b{i}"] = \
            _block_ratios(core.blocks[i], seen[i])
    return out
