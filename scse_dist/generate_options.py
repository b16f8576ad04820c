"""Generation's options as a command line states them, without torch: sampling settings, cache
modes, the exit rule's default cap, self-speculative decoding's DRAFT_DEPTH[,K]. scse-generate
checks them before importing torch; scse_dist.sampling, .speculative and .generate use them."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_CHOICES = ("exact", "shared", "none")
# --exit without --depth (and no max=) caps at this many times the model's depth: at the model's
# own depth a rule could only end tokens before the depth they would run anyway, never deeper.
EXIT_CAP_FACTOR = 8
DEFAULT_DRAFT_TOKENS = 4


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


def parse_speculative(text: str) -> tuple[int, int]:
    """"D" or "D,K" (the draft depth, the drafted tokens per round; K default 4) -> (D, K)."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f"speculative: expected DRAFT_DEPTH[,K] with positive integers (e.g. "
                         f"2,4), got {text!r}")
    return values[0], values[1] if len(values) == 2 else DEFAULT_DRAFT_TOKENS
