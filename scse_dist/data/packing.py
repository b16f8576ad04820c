"""WindowPacker: token runs laid end to end into (rows, width) int64 windows, one copy per token
(the loader's hot path: widened from the shard's dtype in that copy); each full window is a fresh
array the caller may keep (torch.from_numpy shares it).
"""

from __future__ import annotations

import numpy as np


class WindowPacker:
    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.size = rows * width
        self._out = np.empty(self.size, np.int64)
        self._fill = 0

    def add(self, run: np.ndarray) -> list[np.ndarray]:
        """Append `run`; return the windows it completed, each (rows, width) int64."""
        full = []
        start = 0
        while start < len(run):
            take = min(len(run) - start, self.size - self._fill)
            self._out[self._fill:self._fill + take] = run[start:start + take]
            self._fill += take
            start += take
            if self._fill == self.size:
                full.append(self._out.reshape(self.rows, self.width))
                self._out, self._fill = np.empty(self.size, np.int64), 0
        return full

    def remainder(self) -> np.ndarray:
        """The whole rows of the unfinished window, (k, width) with k < rows; the tail of a
        partial row is dropped."""
        k = self._fill // self.width
        return self._out[:k * self.width].reshape(k, self.width)
