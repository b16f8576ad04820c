"""A continuation as text, without torch: what new tokens add after their prompt, and its stream
to the terminal as tokens arrive (scse-generate, the trainer's samples)."""

from __future__ import annotations

import sys
from typing import Sequence


def continuation_text(tokenizer, prompt_ids: Sequence[int], new: Sequence[int]) -> str:
    """The text the new tokens add after the prompt: decoded together with the prompt, so the
    continuation keeps its leading space (a first new token '▁the' decodes alone as 'the')."""
    new = [t for t in new if t != tokenizer.eos_id]
    before, text = tokenizer.decode(list(prompt_ids)), tokenizer.decode(list(prompt_ids) + new)
    return text[len(before):] if text.startswith(before) else tokenizer.decode(new)


class TextStream:
    """Prints a sequence's continuation as tokens arrive (decoding prompt + continuation each
    time, so pieces that merge across tokens, and the first token's space, print right)."""

    ids: list[int]

    def __init__(self, tokenizer, prompt_ids: Sequence[int], out=None) -> None:
        self.tokenizer, self.prompt_ids = tokenizer, list(prompt_ids)
        self.out, self.ids, self.printed = out or sys.stdout, [], ""

    def __call__(self, row: int, token: int) -> None:
        if token == self.tokenizer.eos_id:
            return
        self.ids.append(token)
        text = continuation_text(self.tokenizer, self.prompt_ids, self.ids)
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text
