"""Third-party noise: quiet by default, shown with `-v`/`--verbose` (or `SCSE_VERBOSE=1`, which the
flags set, so library code and child processes see one switch).

- DeepSpeed's accelerator notice without CUDA: `DS_ACCELERATOR=cpu` set before it is imported.
- DeepSpeed's zero_to_fp32 prints and bar: `quiet_output()` holds them, shown only on failure.
- wandb's run footer: `wandb_settings()`.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from typing import Any, Iterator

VERBOSE_ENV = "SCSE_VERBOSE"


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0")


def set_verbose(verbose: bool) -> None:
    """A command's -v: recorded in the environment, where the library code reads it."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"


def add_verbose_flag(parser: Any) -> None:
    """-v/--verbose on a command's ArgumentParser; pass its value to set_verbose."""
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show DeepSpeed's and wandb's own progress lines and warnings")


def name_cpu_accelerator() -> None:
    """Call before importing DeepSpeed: without CUDA, DS_ACCELERATOR=cpu (unless set or verbose)."""
    if is_verbose() or "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


class _HeldForThisThread(io.TextIOBase):
    """A stream that holds what this thread writes and passes other threads' writes through (a
    checkpoint upload thread's report must not be dropped with a library's chatter)."""

    def __init__(self, original: Any, held: io.StringIO) -> None:
        self.original, self.held, self.thread = original, held, threading.current_thread()

    def write(self, text: str) -> int:
        mine = threading.current_thread() is self.thread
        return (self.held if mine else self.original).write(text)

    def flush(self) -> None:
        self.original.flush()


@contextlib.contextmanager
def quiet_output() -> Iterator[None]:
    """What the block prints (stdout and stderr, through Python, from this thread) is dropped
    when it succeeds and printed on stderr when it raises; verbose: printed as it comes."""
    if is_verbose():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(_HeldForThisThread(sys.stdout, held)), \
                contextlib.redirect_stderr(_HeldForThisThread(sys.stderr, held)):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


def wandb_settings() -> Any:
    """wandb.init's settings: its footer quiet unless verbose."""
    import wandb

    return wandb.Settings(quiet=not is_verbose())
