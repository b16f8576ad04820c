"""One writer per run directory: RUN/.lock, held by the one process that writes the run dir
(training's rank 0, an export into the run dir, a study writing its runs' configs).

The lock is a file created with O_CREAT | O_EXCL, which is atomic on local disks and on shared
file systems (NFS, Lustre) where flock is advisory or absent. It holds JSON: host, pid, Slurm job
id (SLURM_JOB_ID, or null), start time and a heartbeat that a daemon thread of the holder renews
every HEARTBEAT_S seconds. A lock is stale when its host is this host and its pid is gone, or when
its heartbeat is older than STALE_AFTER_S (a holder on another node that died). A stale lock is
taken over (renamed aside, then created anew) with one line on stderr; a live one refuses the
second writer with RunDirBusy: one line naming the holder, exit 75 (try again later), which the
launchers requeue. The lock is removed when its holder ends (an exception, Ctrl-C and preemption
included); one a SIGKILL left behind is stale at once on its own host.

No torch and nothing above the config layer is imported here.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

from scse_dist.atomic import pid_alive
from scse_dist.cli_errors import TryLater

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0  # how often the holder renews its heartbeat
STALE_AFTER_S = 600.0  # a heartbeat older than this: the holder is taken for dead (10 minutes)
_TAKEOVER_TRIES = 5


class RunDirBusy(TryLater):
    """Another live process holds the run dir's lock (exit 75: rerun when it has ended)."""


def _read(path: Path) -> tuple[Optional[bytes], dict, float]:
    """(the lock's bytes or None when there is none, its record ({} if unreadable), mtime)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
            mtime = os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None, {}, 0.0
    try:
        record = json.loads(data)
    except ValueError:  # being written this instant, or damaged: its age decides
        record = None
    return data, record if isinstance(record, dict) else {}, mtime


def heartbeat_age(record: dict, mtime: float) -> float:
    """Seconds since the holder's last heartbeat (the file's mtime when the record has none)."""
    beat = record.get("heartbeat")
    return time.time() - (beat if isinstance(beat, (int, float)) else mtime)


def stale_reason(record: dict, mtime: float) -> Optional[str]:
    """Why a lock is stale (None: its holder may be alive)."""
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        return f"its process {pid} on this host is gone"
    age = heartbeat_age(record, mtime)
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    return None


def describe_holder(record: dict, mtime: float) -> str:
    """'host H, pid P, Slurm job J, heartbeat N s ago'."""
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, Slurm job "
            f"{record.get('job') or 'none'}, heartbeat {heartbeat_age(record, mtime):.0f} s ago")


class RunLock:
    """The lock on one run dir, held by this process from acquire() to release()."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.record: dict = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> "RunLock":
        """Create the lock (taking over a stale one), or raise RunDirBusy naming the holder."""
        now = time.time()
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "job": os.environ.get("SLURM_JOB_ID") or None, "started": now,
                       "heartbeat": now, "token": uuid.uuid4().hex}
        for _ in range(_TAKEOVER_TRIES):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.record))
            self._remove_dead_heartbeats()
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name=f"heartbeat {self.path}")
            self._thread.start()
            return self
        raise self._busy()

    def _heartbeat_tmp(self, pid: int) -> Path:
        return self.path.with_name(f".tmp-{LOCK_NAME}.{socket.gethostname()}.{pid}")

    def _remove_dead_heartbeats(self) -> None:
        """A heartbeat's temporary file that a killed holder on this host left behind."""
        for tmp in self.path.parent.glob(f".tmp-{LOCK_NAME}.*"):
            pid = tmp.name.rpartition(".")[2]
            if pid.isdigit() and tmp == self._heartbeat_tmp(int(pid)) and not pid_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()

    def _busy(self) -> RunDirBusy:
        _, record, mtime = _read(self.path)
        return RunDirBusy(f"{self.run_dir} is being written by another process ("
                          f"{describe_holder(record, mtime)}; lock {self.path}): rerun when it has "
                          f"ended (a lock whose process is gone, or without a heartbeat for "
                          f"{STALE_AFTER_S:.0f} s, is taken over)")

    def _take_over_if_stale(self) -> None:
        """Move a stale lock aside (one atomic rename: of two takers, one wins) and remove it."""
        data, record, mtime = _read(self.path)
        if data is None:  # released meanwhile: the next try creates it
            return
        reason = stale_reason(record, mtime)
        if reason is None:
            raise self._busy()
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another process took it over first
            return
        moved, _, _ = _read(aside)
        if moved != data:  # a new holder's lock was renamed: put it back, unless another came
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        else:
            print(f"{self.run_dir}: took over a stale lock ({describe_holder(record, mtime)}): "
                  f"{reason}", file=sys.stderr, flush=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)

    def _ours(self) -> bool:
        _, record, _ = _read(self.path)
        return bool(self.record) and record.get("token") == self.record["token"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.renew()
            except OSError as exc:  # the run dir went away, the file system hiccuped: next time
                print(f"{self.path}: heartbeat not written: {exc}", file=sys.stderr, flush=True)

    def renew(self) -> None:
        """Write a new heartbeat (a temporary file renamed over the lock, so readers see a whole
        record); a lock taken over meanwhile is left to its new holder."""
        data, record, _ = _read(self.path)
        if data is None or record.get("token") != self.record.get("token"):
            if data is not None:  # gone with its run dir (a start refused) needs no word
                print(f"{self.path}: this process's lock was taken over (no heartbeat for "
                      f"{STALE_AFTER_S:.0f} s?); another process may be writing the run dir",
                      file=sys.stderr, flush=True)
            self._stop.set()
            return
        self.record["heartbeat"] = time.time()
        tmp = self._heartbeat_tmp(os.getpid())
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's."""
        self._stop.set()
        if self.record.get("pid") != os.getpid():  # a forked child: the lock is its parent's
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self._ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.record = {}


_HELD: dict[Path, tuple[RunLock, int]] = {}  # this process's locks and how often each is entered


@contextlib.contextmanager
def held(run_dir: str | os.PathLike) -> Iterator[RunLock]:
    """The run dir's lock for the body (re-entrant in one process); RunDirBusy when another live
    process holds it. The run dir must exist."""
    key = Path(run_dir).resolve()
    lock, count = _HELD.get(key, (None, 0))
    if lock is None:
        lock = RunLock(run_dir).acquire()
    _HELD[key] = (lock, count + 1)
    try:
        yield lock
    finally:
        lock, count = _HELD.pop(key)
        if count > 1:
            _HELD[key] = (lock, count - 1)
        else:
            lock.release()


def drop_held() -> None:
    """Remove this process's lock files at once (a signal handler's os._exit skips `finally`)."""
    for lock, _ in list(_HELD.values()):
        if lock.record.get("pid") == os.getpid() and lock._ours():
            with contextlib.suppress(OSError):
                os.unlink(lock.path)


@atexit.register
def _release_at_exit() -> None:  # an exit that skipped `held`'s own release
    for lock, _ in list(_HELD.values()):
        lock.release()
