"""Self-speculative decoding's two model calls: a draft at loop depth d, its verification to T.

Step t of a token reads only steps <= t, so a drafted token's first d steps are the full model's:
`draft` computes them once (filling their K/V slots) and `verify` runs only steps d..T-1 over all
drafted positions in one call. The draft's coda has its own slots ("draft_coda", i). The decoding
loop is scse_dist.generate.speculative.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, LoopKV

# Per-position entries of the loop's context that verification reuses (scse: h*, r*, ref).
POSITION_KEYS = ("source", "anchor", "response", "ref")


class Drafted(NamedTuple):
    logits: Optional[torch.Tensor]  # (B, S, V) at the draft depth (None: readout=False)
    x: torch.Tensor  # (B, S, d_model) the loop variable after the draft's steps
    context: dict  # POSITION_KEYS present, and RoPE's "cos"/"sin" (B, 1, S, head_dim/2)


def check_draft_depth(draft_depth: int, depth: int) -> None:
    if not 1 <= draft_depth < depth:
        raise ValueError(f"speculative: the draft depth must lie in 1..{depth - 1} (below the "
                         f"depth {depth}), got {draft_depth}")


@torch.no_grad()
def draft(model, tokens: torch.Tensor, cache: KVCache, draft_depth: int, depth: int,
          attention_mask: Optional[torch.Tensor] = None, readout: bool = True) -> Drafted:
    """New tokens through the prelude, the loop's first `draft_depth` steps and the draft's coda:
    their depth-d logits and what `verify` continues from; commits the tokens to the cache.
    readout=False skips the head (a round's last drafted token: only its K/V are needed)."""
    check_draft_depth(draft_depth, depth)
    if cache.mode != "exact":
        raise ValueError("speculative: needs the exact cache (a shared slot holds only the last "
                         "step's K/V, which a draft does not reach)")
    attention_mask = torch.ones_like(tokens) if attention_mask is None else attention_mask
    h, rope, mask = model.cached_prelude(tokens, cache, depth, attention_mask)
    core = model.core
    x, ctx = core.start(h, None, rope, mask, LoopKV(cache, core))
    for t in range(draft_depth):
        x = core.step(x, ctx, t)
    h = model.cached_head_input(core.state(x, ctx), rope, mask, cache, "draft_coda")
    logits = F.linear(h, model.head_weight) if readout else None
    cache.commit(attention_mask)
    context = {key: ctx[key] for key in POSITION_KEYS if key in ctx}
    context["cos"], context["sin"] = rope
    return Drafted(logits, x, context)


@torch.no_grad()
def verify(model, drafts: Sequence[Drafted], cache: KVCache, draft_depth: int) -> torch.Tensor:
    """Full-depth logits (B, S, V) of the drafted positions, the last S tokens in the cache:
    loop steps draft_depth..T-1 from each draft's loop variable, one call over all of them, then
    the coda and head. Appends their K/V to those steps' slots and the coda's."""
    x = torch.cat([d.x for d in drafts], dim=1)
    ctx: dict[str, Any] = {key: torch.cat([d.context[key] for d in drafts], dim=1)
                           for key in POSITION_KEYS if key in drafts[0].context}
    ctx["cos"], ctx["sin"] = (torch.cat([d.context[key] for d in drafts], dim=-2)
                              for key in ("cos", "sin"))
    mask = ctx["mask"] = cache.trailing_mask(x.shape[1])
    core = model.core
    ctx["kv"] = LoopKV(cache, core)
    assert cache.depth is not None  # the prefill fixed it
    for t in range(draft_depth, cache.depth):
        x = core.step(x, ctx, t)
    logits = F.linear(model.cached_head_input(core.state(x, ctx), (ctx["cos"], ctx["sin"]), mask,
                                              cache), model.head_weight)
    cache.commit_slots()
    return logits
