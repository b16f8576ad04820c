"""MixedStream: batches drawn from several corpora (TokenStreams) with fixed weights. Batch i
comes wholly from corpus `choice(i)`, drawn from rng(seed, block) in blocks of BLOCK batches: the
same on every rank, run and resume. Each corpus keeps its own TokenStream and exact resume.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

BLOCK = 4096


class MixedStream:
    def __init__(self, streams: list[Any], weights: list[float], seed: int = 0):
        if not streams or len(weights) != len(streams) or any(w <= 0 for w in weights):
            raise ValueError(f"data.mixture_weights: need one positive weight per corpus, got "
                             f"{weights} for {len(streams)} corpora")
        self.streams, self.seed = streams, seed
        self.probs = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.consumed = 0
        self._block: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    def choice(self, i: int) -> int:
        """The corpus of batch i."""
        block = i // BLOCK
        if self._block[0] != block:
            rng = np.random.default_rng([self.seed, 0x6D6978, block])  # "mix"
            self._block = (block, rng.choice(len(self.streams), size=BLOCK, p=self.probs))
        return int(self._block[1][i % BLOCK])

    @property
    def failures(self) -> int:
        return sum(s.failures for s in self.streams)

    @property
    def epoch(self) -> int:
        return min(s.epoch for s in self.streams)

    def __iter__(self) -> Iterator[torch.Tensor]:
        iters: dict[int, Iterator[torch.Tensor]] = {}
        while True:
            c = self.choice(self.consumed)
            if c not in iters:  # started lazily: a corpus never drawn costs no workers
                iters[c] = iter(self.streams[c])
            batch = next(iters[c], None)
            if batch is None:
                return  # a finite corpus ran out
            self.consumed += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"mixture": [s.path for s in self.streams], "weights": self.probs.tolist(),
                "consumed_batches": self.consumed,
                "corpora": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mixture") != [s.path for s in self.streams] or \
                not np.allclose(state.get("weights", []), self.probs):
            raise ValueError(f"cannot resume data stream: the mixture was {state.get('mixture')} "
                             f"with weights {state.get('weights')}, now "
                             f"{[s.path for s in self.streams]} with {self.probs.tolist()} "
                             "(data.mixture_paths / data.mixture_weights)")
        for stream, sub in zip(self.streams, state["corpora"]):
            stream.load_state_dict(sub)
        self.consumed = int(state["consumed_batches"])

    def resume(self, states: list[dict[str, Any]]) -> None:
        """Resume from every rank's state, at any layout (TokenStream.resume per corpus); batch i
        still comes from corpus choice(i), as the batch count is the same on every rank."""
        first = states[0]
        self.load_state_dict({**first, "corpora": []})  # checks the mixture, sets consumed
        for c, stream in enumerate(self.streams):
            stream.resume([st["corpora"][c] for st in states])
