"""Generation's options as a command line states them, without torch: sampling settings, cache
modes, the exit rule's default cap, self-speculative decoding's DRAFT_DEPTH[,K|,auto]. scse-generate
checks them before importing torch; the package's sampling, speculative and core use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

CACHE_CHOICES = ("exact", "shared", "none")
# --exit without --depth (and no max=) caps at this many times the model's depth: at the model's
# own depth a rule could only end tokens before the depth they would run anyway, never deeper.
EXIT_CAP_FACTOR = 8
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 32


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: sample from the smallest set of tokens with this much mass
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must lie in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class AdaptiveDraft:
    """K, the tokens drafted per round, chosen from the rounds before (`--speculative D,auto`):
    from `start`, +2 after a round whose drafts every unfinished row kept, else -1 (never below
    1), and <= `max` (and below the tokens left)."""
    start: int = DEFAULT_DRAFT_TOKENS
    max: int = MAX_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.max:
            raise ValueError(f"speculative: auto's start K must lie in 1..max ({self.max}), got "
                             f"{self.start}")

    def next(self, k: int, all_kept: bool) -> int:
        return min(k + 2, self.max) if all_kept else max(k - 1, 1)

    def __str__(self) -> str:
        return "auto" if self.max == MAX_DRAFT_TOKENS else f"auto:{self.max}"


# speculative decoding's K: a fixed number of drafted tokens per round, or the adaptive schedule
DraftTokens = Union[int, AdaptiveDraft]
SPECULATIVE_FORM = "DRAFT_DEPTH[,K|,auto[:MAX]]"


def parse_speculative(text: str) -> tuple[int, DraftTokens]:
    """"D", "D,K", "D,auto" or "D,auto:MAX" (the draft depth; the drafted tokens per round, K
    default 4, or K adapted per round up to MAX, default 32) -> (D, K or AdaptiveDraft)."""
    depth, comma, k = text.partition(",")
    draft_depth = _positive(depth)
    if draft_depth is None:
        raise ValueError(f"speculative: expected {SPECULATIVE_FORM}; DRAFT_DEPTH must be a "
                         f"positive integer, got {depth!r} in {text!r}")
    if not comma:
        return draft_depth, DEFAULT_DRAFT_TOKENS
    draft_tokens = _draft_tokens(k)
    if draft_tokens is None:
        raise ValueError(f"speculative: expected {SPECULATIVE_FORM}; K must be a positive "
                         f"integer, auto or auto:MAX (MAX a positive integer), got {k!r} in "
                         f"{text!r}")
    return draft_depth, draft_tokens


def _draft_tokens(text: str) -> Optional[DraftTokens]:
    if text == "auto":
        return AdaptiveDraft()
    if text.startswith("auto:"):
        cap = _positive(text[len("auto:"):])
        return None if cap is None else AdaptiveDraft(min(DEFAULT_DRAFT_TOKENS, cap), cap)
    return _positive(text)


def _positive(text: str) -> Optional[int]:
    """A positive integer's value, else None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None
