"""Text generation: greedy, temperature and top-p sampling over LoopedLM.decode_step's KV cache,
and self-speculative decoding (scse_dist.generate.speculative)."""

from __future__ import annotations

from typing import Callable, Literal, Optional, Sequence, cast

import torch

from scse_dist.generate.options import CACHE_CHOICES, DraftTokens
from scse_dist.generate.sampling import Generation, Sampling, left_pad, next_tokens
from scse_dist.generate.speculative import speculative_generate
from scse_dist.model.kv_cache import KVCache


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             depth: Optional[int] = None, sampling: Sampling = Sampling(),
             eos_id: Optional[int] = None, cache: str = "exact", exit_rule=None,
             on_token: Optional[Callable[[int, int], None]] = None,
             speculative: Optional[tuple[int, DraftTokens]] = None,
             generator: Optional[torch.Generator] = None,
             stop: Optional[Callable[[int, list[int]], bool]] = None) -> Generation:
    """Continue every prompt (token ids, non-empty) by up to max_new_tokens, stopping a sequence
    at eos_id. cache: "exact" / "shared" (KVCache modes) or "none" (recompute the whole sequence
    for each token). on_token(row, token) is called for each new token as it is chosen.
    generator: sampling's random numbers (default: seeded with sampling.seed). stop(row, new
    tokens) -> True also ends a row. speculative=(d, K): self-speculative decoding, K tokens
    (an int or AdaptiveDraft()) drafted at loop depth d per round."""
    if cache not in CACHE_CHOICES:
        raise ValueError(f"cache: must be one of {', '.join(CACHE_CHOICES)}; got {cache!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    if speculative is not None:
        if cache != "exact" or exit_rule is not None or generator is not None or stop:
            raise ValueError("speculative: runs with the exact cache and a fixed depth (no exit "
                             "rule, no shared or no cache, no generator or stop)")
        return speculative_generate(model, prompts, max_new_tokens=max_new_tokens,
                                    draft_depth=speculative[0], draft_tokens=speculative[1],
                                    depth=depth, sampling=sampling, eos_id=eos_id,
                                    on_token=on_token)
    device = next(model.parameters()).device
    tokens, mask = (t.to(device) for t in left_pad(prompts))
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    # checked against CACHE_CHOICES above
    kv = KVCache(cast(Literal["exact", "shared"], cache)) if cache != "none" else None
    new: list[list[int]] = [[] for _ in prompts]
    steps: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    step_in, mask_in = tokens, mask
    for _ in range(max_new_tokens):
        # no cache: the reference, a fresh cache over the whole sequence, used once
        x, cache_x, mask_x = (tokens, KVCache(), mask) if kv is None else (step_in, kv, mask_in)
        out = model.decode_step(x, cache_x, depth=depth, attention_mask=mask_x, exit_rule=exit_rule)
        chosen = next_tokens(out.logits[:, -1], sampling, generator)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            new[row].append(token)
            steps[row].append(int(out.steps[row, -1]))
            if on_token is not None:
                on_token(row, token)
            done[row] = token == eos_id or (stop is not None and stop(row, new[row]))
        if all(done):
            break
        step_in, mask_in = chosen[:, None], torch.ones_like(chosen)[:, None]
        tokens, mask = torch.cat([tokens, step_in], 1), torch.cat([mask, mask_in], 1)
    return Generation(new, steps)
