"""Third-party noise: quiet by default, shown with `-v`/`--verbose` (or `SCSE_VERBOSE=1`, which the
flags set, so library code and child processes see one switch; the trainer reads only the
variable).

What is quietened, and how:
- DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
  detect it." on every import on a machine without CUDA: `DS_ACCELERATOR=cpu`, DeepSpeed's own
  override, is set there before DeepSpeed is imported (never over a value the user set), so it
  does not go looking.
- DeepSpeed's zero_to_fp32 (consolidating a checkpoint's ZeRO partitions, e.g. `scse-eval` on a
  checkpoint dir and the trainer's export): four print() lines and a tqdm bar, with no switch of
  its own. `quiet_output()` holds them and prints them on stderr only if the block fails, so
  nothing that explains a failure is lost.
- wandb's run footer (history and summary sparklines, ~30 lines at the end of a training run):
  `wandb.Settings(quiet=...)` from `wandb_settings()`; the lines saying where the run is saved stay.
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
