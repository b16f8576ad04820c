"""Crash retries of a training job: which failures requeue it, the record of its failed starts
(RUN/logs/retries.json), and the refusal to loop on a failure that repeats.

0 and 75 are not failures, NEVER_RETRIED's would fail again, anything else is a crash: the first
rank whose trainer failed claims the start (created exclusively: later ranks decide nothing) and
requeues the job, unless it would loop or its retries are used (docs/launching.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from scse_dist.atomic import atomic_write_text
from scse_dist.cli_errors import EXIT_NO_SPACE
from scse_dist.launch.backends import BackendError, current_backend
from scse_dist.launch.children import REQUEUE_EXIT_CODE
from scse_dist.run_dir import CHECKPOINTS_NAME, RunDir

RECORD_NAME = "retries.json"  # in RUN/logs
CLAIMS_NAME = "retries"  # RUN/logs/retries/<job>.<start>: the start's failure was decided
NEVER_RETRIED = {2: "bad config", 3: "non-finite steps", 4: "loss spikes", 65: "bad input data",
                 66: "a missing or unreadable input",
                 74: "no space left: a full disk, a quota or a file-size limit",
                 130: "a second Ctrl-C"}
# scse_dist.train.loop prints it on the rank whose step raised: rank, last finished step, error
CRASH_LINE = re.compile(r"^scse-train: rank (\d+) crashed after step (\d+): (.+)$")
# what differs between two starts of the same failure: object addresses, a peer's port
_VARYING = [(re.compile(r"0x[0-9a-fA-F]+"), "0x?"), (re.compile(r"(\]|\d):\d{2,5}\b"), r"\1:?")]


def is_crash(status: int) -> bool:
    """Whether an exit status of training is a crash, which a retry may get past."""
    return status not in (0, REQUEUE_EXIT_CODE) and status not in NEVER_RETRIED


@dataclass
class Failure:
    """One failed start, as retries.json records it."""

    job: str
    start: int  # 0: the job's first start
    rank: int
    exit: int
    step: int  # the last step it finished
    signature: str  # the error (or the exit status / signal when the trainer said nothing)
    latest_checkpoint: Optional[str]  # the tag `latest` named when it failed
    decision: str = ""  # retry | stop
    time: str = ""


class CrashWatch:
    """run_child's on_stderr_line for the trainer: passes every line on to this process's stderr
    and keeps the last non-blank one and the crash line, if the trainer printed one."""

    def __init__(self) -> None:
        self.crash: Optional[tuple[int, int, str]] = None  # rank, step, error
        self.last = ""

    def __call__(self, line: str) -> None:
        sys.stderr.write(line)
        sys.stderr.flush()
        self.last = line.strip() or self.last
        found = CRASH_LINE.match(line.rstrip("\n"))
        if found:
            self.crash = int(found[1]), int(found[2]), found[3]


def _last_logged_step(run_dir: Path) -> int:
    """The last step metrics.jsonl holds (where a rank that said nothing got to, roughly)."""
    for row in reversed(RunDir(run_dir).metric_rows()):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(row["step"])
    return 0


def failure_of(status: int, rank: int, watch: CrashWatch, run_dir: Path, job: str,
               start: int) -> Failure:
    if watch.crash is not None:
        rank, step, signature = watch.crash
        for varying, same in _VARYING:
            signature = varying.sub(same, signature)
    else:  # killed (OOM, a segfault) or died before the loop: the status is all there is
        step = _last_logged_step(run_dir)
        signature = f"killed by {signal.Signals(-status).name}" if status < 0 else \
            f"exit {status}"
    latest = None  # the checkpoint tag `latest` names, if any
    with contextlib.suppress(OSError):
        latest = (run_dir / CHECKPOINTS_NAME / "latest").read_text().strip() or None
    return Failure(job, start, rank, status, step, signature, latest)


def _claim(claims: Path, job: str, start: int) -> bool:
    claims.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(claims / f"{job}.{start}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def read_record(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["starts"]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError):  # unreadable: the retries start counting afresh
        print(f"scse-launch: {path} is not a retry record; starting a new one", file=sys.stderr)
        return []


def decide(logs: Path, failure: Failure, max_retries: int) -> Optional[tuple[bool, str]]:
    """Record `failure` with its decision: (retry or not, the one line that says so). None:
    another rank already decided this start (nothing recorded)."""
    if not _claim(logs / CLAIMS_NAME, failure.job, failure.start):
        return None
    record = logs / RECORD_NAME
    starts = read_record(record)
    earlier = [s for s in starts if s.get("job") == failure.job]
    same = next((s for s in earlier if s.get("step") == failure.step
                 and s.get("signature") == failure.signature), None)
    retried = sum(s.get("decision") == "retry" for s in earlier)
    what = (f"scse-launch: training crashed on rank {failure.rank} after step {failure.step} "
            f"(exit {failure.exit}: {failure.signature})")
    failure.decision = "stop"
    if failure.exit in NEVER_RETRIED:
        then = "free space, then submit the same job again: it resumes from the last " \
            "checkpoint" if failure.exit == EXIT_NO_SPACE else "a rerun would fail the same way"
        line = (f"scse-launch: training stopped on rank {failure.rank} with exit {failure.exit} "
                f"({NEVER_RETRIED[failure.exit]}): not retrying, {then}")
    elif same is not None:
        line = (f"{what}: the same failure after the same step as start {same['start'] + 1} of "
                f"job {failure.job}; not retrying, it would fail again ({record})")
    elif retried >= max_retries:
        line = f"{what}: not retrying, launch.max_retries={max_retries} " + \
            ("" if max_retries == 0 else f"and {retried} retries used ") + f"({record})"
    else:
        failure.decision = "retry"
        line = (f"{what}: retry {retried + 1} of {max_retries}, requeueing job {failure.job}; "
                f"it resumes from the latest verified checkpoint "
                f"({failure.latest_checkpoint or 'none yet: from the start'})")
    failure.time = time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic_write_text(record, json.dumps({"starts": [*starts, asdict(failure)]}, indent=2) + "\n")
    return failure.decision == "retry", line


def after_failure(logs: Path, max_retries: int, status: int, rank: int,
                  watch: CrashWatch) -> None:
    """After the trainer failed on its own, in a job of a backend that requeues: decide (a status
    never retried as a stop) and maybe requeue."""
    where = current_backend()
    if not (is_crash(status) or status in NEVER_RETRIED) or where is None or \
            not where[0].requeues:
        return
    backend, job = where
    failure = failure_of(status, rank, watch, logs.parent, job, backend.current_start())
    decided = decide(logs, failure, max_retries)
    if decided is None:
        return
    retry, line = decided
    if retry:
        try:
            backend.requeue(job)
        except BackendError as exc:
            line += f"; the requeue failed: {exc}"
    print(line, file=sys.stderr, flush=True)
