"""Steps used per token under an exit rule (`scse-eval --exit`): a histogram over the tokens
whose predictions are scored, and its mean and percentiles for the results JSON and the table."""

from __future__ import annotations

from typing import Optional

import torch

from scse_dist.model.exit_rules import ExitRule

PERCENTILES = (10, 50, 90, 99)


class ExitStats:
    """An exit rule and the steps its tokens used, summed over an evaluation."""

    def __init__(self, rule: ExitRule) -> None:
        self.rule = rule
        self.counts = torch.zeros(0, dtype=torch.long)  # counts[k]: scored tokens that took k steps

    def depth(self, depths: list[int]) -> int:
        """The cap of the run: the rule's max_steps, else the largest depth asked for."""
        return self.rule.cap(max(depths))

    def add(self, steps_used: torch.Tensor, scored: Optional[torch.Tensor] = None) -> None:
        """steps_used (B, S) from the model's output; scored (B, S) bool: the tokens that count."""
        steps = steps_used if scored is None else steps_used[scored]
        counts = torch.bincount(steps.flatten().cpu(), minlength=len(self.counts))
        counts[:len(self.counts)] += self.counts
        self.counts = counts

    def summary(self) -> dict:
        """mean_steps, steps_pNN, the histogram {steps: tokens}, and the rule's text."""
        total = int(self.counts.sum())
        if total == 0:
            return {"exit": str(self.rule), "mean_steps": None}
        steps = torch.arange(len(self.counts), dtype=torch.float64)
        cumulative = self.counts.cumsum(0)
        row = {"exit": str(self.rule),
               "mean_steps": float((steps * self.counts).sum()) / total}
        for p in PERCENTILES:  # the smallest k with at least p% of the tokens at <= k steps
            row[f"steps_p{p}"] = int(torch.searchsorted(cumulative, total * p / 100))
        row["steps_histogram"] = {str(k): int(n) for k, n in enumerate(self.counts.tolist()) if n}
        return row
