"""How a next token is chosen from logits: greedy, temperature and top-p (scse-generate's, also
lm-eval's and self-speculative decoding's), and the left-padded batch generation starts from."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from scse_dist.generate.options import Sampling  # noqa: F401 (defined without torch; API here)


class Generation(NamedTuple):
    tokens: list[list[int]]  # new tokens per sequence, up to and including EOS
    steps: list[list[int]]  # loop steps each new token's input ran (its exit step under a rule)
    speculation: Optional[dict] = None  # self-speculative decoding's counts (speculative.py)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, attention_mask), both (B, max_len): prompts right-aligned, padding masked."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return tokens, mask


def token_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(..., V) logits -> the distribution the next token is drawn from, in fp32: temperature
    and top-p applied; greedy (temperature 0) is one-hot at the argmax."""
    if sampling.temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(
            -1, logits.argmax(-1, keepdim=True), 1.0)
    probs = (logits.float() / sampling.temperature).softmax(-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
    return probs


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
                ) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens (greedy draws no random number)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(token_probs(logits, sampling), 1, generator=generator).squeeze(-1)
