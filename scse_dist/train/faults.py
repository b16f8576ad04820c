"""Faults during training: preemption signals, non-finite steps, and fault injection for tests.

Exit statuses of `scse-train` / `launch/train.py` (documented in docs/checkpoints.md):
  0   finished (checkpoint and export written)
  2   config error, before any process group started
  3   stopped after `train.max_nonfinite_steps` non-finite steps in a row; the last good
      checkpoint is left untouched
  4   stopped after `train.spike_skip.max_in_a_row` loss spikes in a row; the last good
      checkpoint is left untouched
  75  preempted (SIGTERM, SIGUSR1 or Ctrl-C): the step in flight finished, a checkpoint was
      saved, rerun (e.g. `scontrol requeue`) to resume. 75 is EX_TEMPFAIL, "try again later".
  130 a second Ctrl-C: stopped at once, nothing saved (the last checkpoint is intact)

Fault injection (`SCSE_FAULT`, comma-separated `kind@step[:rankR]`, steps 1-based as in the
metrics; no rank means every rank) lets tests drive these paths in real processes:
  nan@7               step 7's loss is multiplied by NaN (so are its gradients)
  spike@7             step 7's loss is multiplied by 1000 (so are its gradients): a loss spike
  sigterm@5:rank1     rank 1 sends itself SIGTERM as step 5 starts (also sigusr1)
  kill@5              SIGKILL as step 5 starts: a crash that saves nothing
  kill_in_save@10     SIGKILL in the middle of saving checkpoint step 10 (files written, not
                      committed)
  kill_in_export@12   SIGKILL in the export of the final step 12, after model.safetensors and
                      before config.yaml
  kill_in_upload@10   SIGKILL after the first file of checkpoint step 10 reached the remote
                      output_dir (committed locally, half uploaded, remote `latest` not moved)
  stall@3             step 3 prints "fault: stalling step 3" and sleeps $SCSE_FAULT_STALL_S
                      seconds (default 60) before it runs: a step in flight to interrupt
  crash@8:rank1       rank 1 raises RuntimeError as step 8 starts, at every start of the job: a
                      crash that repeats (the launcher's retries stop on it)
  crash_once@8        the same, only at the job's first start (SLURM_RESTART_COUNT unset or 0):
                      a crash a retry gets past
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

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
        if self._due("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
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

    def mid_save(self, step: int) -> None:
        if self._due("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def mid_export(self, step: int) -> None:
        if self._due("kill_in_export", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def mid_upload(self, step: int) -> None:
        if self._due("kill_in_upload", step):
            os.kill(os.getpid(), signal.SIGKILL)


class NonFiniteCounter:
    """Counts skipped (non-finite) steps; `max_in_a_row` of them in a row stop the run."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.total = 0
        self.in_a_row = 0

    def update(self, step: int, skipped: bool, last_checkpoint: Optional[str]) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise TrainingStopped(
                f"step {step}: {self.in_a_row} non-finite steps in a row "
                f"(train.max_nonfinite_steps={self.max_in_a_row}); stopping without saving, last "
                f"good checkpoint: {last_checkpoint or 'none'}", NONFINITE_EXIT_CODE)
