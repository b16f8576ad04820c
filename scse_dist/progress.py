"""Progress of long work: a tqdm bar on a terminal; otherwise (a log file) a plain line every
`SCSE_PROGRESS_EVERY_S` seconds (default 30) and one at the end. Only the process that should
talk (rank 0) makes an enabled one; `enabled=False` is a no-op.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Optional, TextIO

EVERY_S_ENV = "SCSE_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0


def format_duration(seconds: Optional[float]) -> str:
    """`1:02:03` for an hour and more, `2:03` below it; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(done: float, total: float, elapsed: float) -> Optional[float]:
    """Seconds left at the rate so far; None before anything is done."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(total - done, 0) * elapsed / done


def _every_s() -> float:
    raw = os.environ.get(EVERY_S_ENV)
    try:
        return float(raw) if raw else DEFAULT_EVERY_S
    except ValueError:
        return DEFAULT_EVERY_S


class Progress:
    """Counts `update(n)` calls towards `total`; see the module docstring for what it prints."""

    def __init__(self, total: Optional[float], desc: str, unit: str = "it", enabled: bool = True,
                 stream: Optional[TextIO] = None, every_s: Optional[float] = None) -> None:
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.done = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._every_s = _every_s() if every_s is None else every_s
        self._postfix: dict[str, Any] = {}
        self._start = self._last_line = time.perf_counter()
        self._printed_at: Optional[float] = None
        self._bar = None
        if enabled and self._stream.isatty():
            import shutil

            from tqdm import tqdm

            # a pty with no window size reports 0 columns, where tqdm draws nothing
            sized = shutil.get_terminal_size((0, 0)).columns > 0
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream,
                             dynamic_ncols=sized, ncols=None if sized else 100, leave=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def update(self, n: float = 1) -> None:
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif time.perf_counter() - self._last_line >= self._every_s:
            self._print_line()

    def set_postfix(self, **values: Any) -> None:
        if not self.enabled:
            return
        self._postfix = values
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def line(self) -> str:
        """`desc: 120/5153 passage, 16.2 passage/s, elapsed 0:07, ETA 5:10[, key value ...]`"""
        elapsed = self.elapsed
        rate = self.done / elapsed if elapsed > 0 else 0.0
        count = f"{self.done:g}/{self.total:g}" if self.total else f"{self.done:g}"
        parts = [f"{self.desc}: {count} {self.unit}", f"{rate:.1f} {self.unit}/s",
                 f"elapsed {format_duration(elapsed)}"]
        if self.total:
            parts.append(f"ETA {format_duration(eta_seconds(self.done, self.total, elapsed))}")
        parts += [f"{key} {value}" for key, value in self._postfix.items()]
        return ", ".join(parts)

    def _print_line(self) -> None:
        print(self.line(), file=self._stream, flush=True)
        self._last_line = time.perf_counter()
        self._printed_at = self.done

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.done and self._printed_at != self.done:
            self._print_line()
        self.enabled = False
