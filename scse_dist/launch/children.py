"""Processes a command starts, stopped with it and never left behind.

`run_child` gives the child a process group of its own (a terminal's Ctrl-C reaches it once,
through the parent), forwards SIGINT, SIGTERM and SIGUSR1 to it, waits for it (training saves and
exits 75), then kills what is left of its group; the parent then stops too (`StoppedBySignal`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
REQUEUE_EXIT_CODE = 75  # scse_dist.train.faults': preempted and saved; a backend may requeue it


@dataclass
class Ended:
    status: int
    signal_name: Optional[str] = None  # the first signal forwarded to the child, if any


class StoppedBySignal(Exception):
    """A signal stopped the command while it ran `what`; `status`: its exit (75: saved, rerun)."""

    def __init__(self, signal_name: str, status: int, what: str) -> None:
        saved = "it saved a checkpoint, rerun to resume" if status == REQUEUE_EXIT_CODE else \
            f"it exited {status}"
        super().__init__(f"stopped by {signal_name} during {what} ({saved})")
        self.signal_name, self.status = signal_name, status


@contextlib.contextmanager
def _handling(signals: Sequence[int], handler: Callable[[int, object], None]) -> Iterator[None]:
    """`handler` for `signals` while the body runs, the previous handlers restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set in the main thread; a thread's child ends with it
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_child(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, stdout=None,
              stderr=None, on_stderr_line: Optional[Callable[[str], None]] = None) -> Ended:
    """Run `argv` to its end with the signals above forwarded; nothing of it is left afterwards.
    With `on_stderr_line`, its stderr is read line by line (text) and handed to that function."""
    proc = subprocess.Popen(list(argv), env=None if env is None else dict(env), stdout=stdout,
                            stderr=subprocess.PIPE if on_stderr_line else stderr,
                            text=bool(on_stderr_line), errors="replace" if on_stderr_line else None,
                            start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    try:
        with _handling(FORWARDED, forward):
            if on_stderr_line:
                assert proc.stderr is not None  # piped when there is a reader
                for line in proc.stderr:
                    on_stderr_line(line)
            status = proc.wait()
    finally:
        if proc.poll() is None:  # the parent itself is failing: take the child with it
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # what it left behind
            os.killpg(proc.pid, signal.SIGKILL)
    return Ended(status, signal.Signals(received[0]).name if received else None)


@contextlib.contextmanager
def stop_on_signals(what: Callable[[], str]) -> Iterator[None]:
    """While the body runs without a child: SIGINT and SIGTERM raise StoppedBySignal (status 75:
    nothing half done is kept, a rerun redoes it); `what()` names the work in progress."""

    def stop(signum: int, frame: object) -> None:
        raise StoppedBySignal(signal.Signals(signum).name, REQUEUE_EXIT_CODE, what())

    with _handling((signal.SIGINT, signal.SIGTERM), stop):
        yield
