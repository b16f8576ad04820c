"""Faults during training: preemption signals, non-finite steps, and fault injection for tests.

Exit statuses: scse_dist.train.cli.EXIT_STATUSES. Fault injection (`SCSE_FAULT`, comma-separated
`kind@step[:rankR]`, steps 1-based as in the metrics; no rank means every rank) drives these
paths in real processes; the kinds (_KINDS) are listed in docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from scse_dist.atomic import NoSpaceError
from scse_dist.cli_errors import EXIT_NO_SPACE
from scse_dist.run_lock import drop_held

REQUEUE_EXIT_CODE = 75
NONFINITE_EXIT_CODE = 3
SPIKE_EXIT_CODE = 4
SPIKE_FACTOR = 1000.0
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
FAULT_ENV = "SCSE_FAULT"
STALL_ENV = "SCSE_FAULT_STALL_S"
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_KINDS = {"nan", "spike", "sigterm", "sigusr1", "kill", "kill_in_save", "kill_in_export",
          "kill_in_upload", "stall", "crash", "crash_once"}
_FIRST_CTRL_C = (b"scse-train: Ctrl-C: finishing the step in flight, saving a checkpoint, then "
                 b"exiting (status 75; rerun to resume). Ctrl-C again stops at once without "
                 b"saving.\n")
_SECOND_CTRL_C = (b"scse-train: interrupted again: stopped without saving (the last checkpoint is "
                  b"intact)\n")


class TrainingStopped(Exception):
    """Training ended early on purpose; `exit_code` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def stopped_when_out_of_space(last_saved: int) -> Iterator[None]:
    """A write that every rank agreed did not fit (a checkpoint, the export: NoSpaceError) ends
    the run in order, exit 74, with one line saying where a rerun resumes."""
    try:
        yield
    except NoSpaceError as exc:
        resume = f"step-{last_saved:07d}" if last_saved > 0 else "the start"
        raise TrainingStopped(f"{exc} (it resumes from {resume})", EXIT_NO_SPACE) from None


class PreemptionFlag:
    """SIGTERM/SIGUSR1 and Ctrl-C (SIGINT) set a flag instead of killing the process; the loop
    reads it once per step (agreed across ranks) so the step in flight finishes and a checkpoint
    is saved. A Ctrl-C after the flag is set exits at once with status 130: the user wants out
    now, and atomic saves leave the last checkpoint intact whatever was in flight."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}  # signal number -> its handler before ours
        self._pid = os.getpid()
        self._ctrl_c = False  # a Ctrl-C came: the next one exits at once
        # one line per Ctrl-C, from rank 0 only (every rank of a terminal's job gets the SIGINT)
        self._says = os.environ.get("RANK", "0") == "0"

    def install(self) -> "PreemptionFlag":
        self._pid = os.getpid()
        for sig in (*PREEMPT_SIGNALS, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        # Only set the flag: a handler runs between bytecodes, possibly inside a collective (or a
        # print: hence os.write, which cannot re-enter a buffered stream).
        if os.getpid() != self._pid:  # a forked data-loader worker: the trainer process decides
            return
        if signum != signal.SIGINT:
            self.signal_name = signal.Signals(signum).name
            return
        if self._ctrl_c:
            self._say(_SECOND_CTRL_C)
            drop_held()  # os._exit skips the `finally` that would release the run dir's lock
            os._exit(INTERRUPTED_EXIT_CODE)
        # set before saying so: a second Ctrl-C that lands during the write must see them
        self._ctrl_c = True
        self.signal_name = self.signal_name or "SIGINT"
        self._say(_FIRST_CTRL_C)

    def _say(self, line: bytes) -> None:
        if self._says:
            os.write(2, line)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: Optional[int]


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        try:
            kind, _, rest = item.partition("@")
            step_s, _, rank_s = rest.partition(":")
            if kind not in _KINDS or (rank_s and not rank_s.startswith("rank")):
                raise ValueError
            faults.append(Fault(kind, int(step_s), int(rank_s[4:]) if rank_s else None))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: cannot parse {item!r}; expected kind@step[:rankR] with "
                             f"kind one of {sorted(_KINDS)}") from None
    return faults


class FaultInjector:
    """The faults of `SCSE_FAULT` that apply to this rank; every hook is a no-op without it."""

    def __init__(self, rank: int, spec: Optional[str] = None) -> None:
        spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
        self.faults = [f for f in parse_faults(spec) if f.rank in (None, rank)]

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.faults)

    def step_started(self, step: int) -> None:
        for kind, sig in (("sigterm", signal.SIGTERM), ("sigusr1", signal.SIGUSR1)):
            if self._due(kind, step):
                os.kill(os.getpid(), sig)
        self._kill_if_due("kill", step)
        if self._due("stall", step):
            print(f"fault: stalling step {step}", flush=True)
            time.sleep(float(os.environ.get(STALL_ENV, "60")))
        first_start = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if self._due("crash", step) or (first_start and self._due("crash_once", step)):
            raise RuntimeError(f"fault: crash at step {step}")

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self._due("nan", step):
            return loss * float("nan")
        return loss * SPIKE_FACTOR if self._due("spike", step) else loss

    def _kill_if_due(self, kind: str, step: int) -> None:
        if self._due(kind, step):
            os.kill(os.getpid(), signal.SIGKILL)

    # SIGKILL in the middle of saving checkpoint `step`, of the final export, of an upload
    mid_save = functools.partialmethod(_kill_if_due, "kill_in_save")
    mid_export = functools.partialmethod(_kill_if_due, "kill_in_export")
    mid_upload = functools.partialmethod(_kill_if_due, "kill_in_upload")

