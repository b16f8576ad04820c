"""One writer per run directory (scse_dist.run_lock): the lock file, a second writer refused with
one line naming the holder (exit 75), stale locks (dead pid on this host, old heartbeat) taken
over with one line, release at every end; then real processes: a second scse-train into a run dir
that a first one is writing is refused and changes nothing, and the first finishes intact."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import console_script
from scse_dist import run_lock
from scse_dist.cli_errors import EXIT_TEMPFAIL, cli_main, exit_status
from scse_dist.launch.children import REQUEUE_EXIT_CODE
from scse_dist.run_lock import LOCK_NAME, STALE_AFTER_S, RunDirBusy, RunLock, held


@pytest.fixture
def live_pid():
    """The pid of a process that runs for the test (another process than this one)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def foreign_lock(run_dir: Path, pid: int, host: str = "", age: float = 0.0,
                 job: str | None = "4242") -> bytes:
    """Write the lock another process would hold; its bytes."""
    now = time.time()
    record = {"host": host or socket.gethostname(), "pid": pid, "job": job, "started": now - age,
              "heartbeat": now - age, "token": "theirs"}
    data = json.dumps(record).encode()
    (run_dir / LOCK_NAME).write_bytes(data)
    return data


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    lock = RunLock(tmp_path).acquire()
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert (record["host"], record["pid"], record["job"]) == (socket.gethostname(), os.getpid(),
                                                              "777")
    assert abs(record["heartbeat"] - time.time()) < 60 and record["started"] <= record["heartbeat"]
    lock.release()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("SLURM_JOB_ID")
    with held(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["job"] is None
    assert list(tmp_path.iterdir()) == []


def test_a_live_holder_refuses_a_second_writer_with_one_line_naming_it(tmp_path, live_pid):
    data = foreign_lock(tmp_path, live_pid, age=3)
    with pytest.raises(RunDirBusy) as refused:
        RunLock(tmp_path).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert f"host {socket.gethostname()}, pid {live_pid}, Slurm job 4242, heartbeat 3 s ago" \
        in message and str(tmp_path) in message
    assert (tmp_path / LOCK_NAME).read_bytes() == data  # nothing changed
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]
    # the exit status a launcher requeues, and one line from every command
    assert exit_status(refused.value) == EXIT_TEMPFAIL == REQUEUE_EXIT_CODE == 75

    @cli_main("scse-x")
    def command(argv=None):
        with held(tmp_path):
            raise AssertionError("the body must not run")

    # (capsys is not used: the assertion below reads the status; the line is checked end to end)
    assert command([]) == 75


def test_a_holder_on_another_host_is_alive_until_its_heartbeat_is_too_old(tmp_path, capsys):
    pid = dead_pid()  # on another host, this host's process table says nothing about it
    foreign_lock(tmp_path, pid, host="node-elsewhere", age=STALE_AFTER_S - 60)
    with pytest.raises(RunDirBusy, match="host node-elsewhere"):
        RunLock(tmp_path).acquire()
    foreign_lock(tmp_path, pid, host="node-elsewhere", age=STALE_AFTER_S + 60)
    with held(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{tmp_path}: took over a stale lock (host node-elsewhere, pid {pid}, "
                           "Slurm job 4242, heartbeat ")
    assert line.endswith(f"s old (stale after {STALE_AFTER_S:.0f} s)")
    assert list(tmp_path.iterdir()) == []  # nothing set aside is left


def test_a_dead_pid_on_this_host_is_stale_at_once(tmp_path, capsys, live_pid):
    pid = dead_pid()
    foreign_lock(tmp_path, pid, job=None)
    # a heartbeat it was writing when it died goes; a live process's, or another host's, stays
    here = socket.gethostname()
    kept = [f".tmp-{LOCK_NAME}.{here}.{live_pid}", f".tmp-{LOCK_NAME}.node-elsewhere.{pid}"]
    for name in [f".tmp-{LOCK_NAME}.{here}.{pid}", *kept]:
        (tmp_path / name).write_text("{}")
    lock = RunLock(tmp_path).acquire()
    line, = capsys.readouterr().err.splitlines()
    assert line == (f"{tmp_path}: took over a stale lock (host {socket.gethostname()}, pid {pid}, "
                    f"Slurm job none, heartbeat 0 s ago): its process {pid} on this host is gone")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_a_lock_being_written_counts_as_held_until_it_is_old(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"")  # created, its record not yet written
    with pytest.raises(RunDirBusy, match="host \\?, pid \\?"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_AFTER_S - 1
    os.utime(tmp_path / LOCK_NAME, (old, old))
    RunLock(tmp_path).acquire().release()


def test_the_heartbeat_is_renewed_and_a_lock_taken_over_is_left_to_its_new_holder(
        tmp_path, monkeypatch, capsys, live_pid):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path).acquire()
    first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
    deadline = time.time() + 30
    while json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] == first:
        assert time.time() < deadline, "no heartbeat"
        time.sleep(0.05)
    theirs = foreign_lock(tmp_path, live_pid)  # as if this one had been taken for dead
    time.sleep(0.3)
    lock.release()
    assert (tmp_path / LOCK_NAME).read_bytes() == theirs
    assert "this process's lock was taken over" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]


def test_held_is_reentrant_and_released_on_any_exit(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with held(tmp_path):
            with held(tmp_path):
                pass
            assert (tmp_path / LOCK_NAME).is_file()  # the inner exit keeps the outer's lock
            raise KeyboardInterrupt
    assert not (tmp_path / LOCK_NAME).exists()
    with held(tmp_path):
        run_lock.drop_held()  # what a second Ctrl-C does before os._exit
        assert not (tmp_path / LOCK_NAME).exists()
    assert list(tmp_path.iterdir()) == []


def test_scse_export_into_a_busy_run_dir_is_refused_before_it_reads_anything(tmp_path, live_pid,
                                                                              capsys):
    from scse_dist.checkpoint import export_cli

    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")
    foreign_lock(run, live_pid)
    before = listing(tmp_path)
    assert export_cli.main([str(run), "--out", str(run / "export")]) == 75
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith(f"scse-export: busy: {run} is being written by another process (host")
    assert f"pid {live_pid}" in line
    assert listing(tmp_path) == before
    # without the lock the same command goes on to read the checkpoint (there is none: 66)
    (run / LOCK_NAME).unlink()
    assert export_cli.main([str(run), "--out", str(run / "export")]) == 66
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]


def test_a_study_does_not_rewrite_the_config_of_a_run_being_trained(tmp_path, tiny_config,
                                                                    live_pid):
    import yaml

    from scse_dist.study.plan import write_study
    from scse_dist.study.spec import load_spec

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "s", "out": str(tmp_path / "studies"),
                                         "base": tiny_config(tmp_path), "seeds": [0],
                                         "variants": {"scse": {"overrides": {}}}}))
    spec = load_spec(str(spec_path))
    run, = write_study(spec, "final")
    config = Path(run.config)
    config.write_text("the trainer's resolved config\n")
    foreign_lock(Path(run.run_dir), live_pid)
    with pytest.raises(RunDirBusy):
        write_study(spec, "final")
    assert config.read_text() == "the trainer's resolved config\n"
    (Path(run.run_dir) / LOCK_NAME).unlink()
    write_study(spec, "final")  # not busy: rewritten, and the lock is gone again
    assert config.read_text() != "the trainer's resolved config\n"
    assert not (Path(run.run_dir) / LOCK_NAME).exists()


def test_the_launcher_requeues_a_busy_run_instead_of_counting_a_crash(tmp_path, monkeypatch):
    """Exit 75 from the trainer (preempted, or its run dir still held by a draining job) is no
    failure to retry.json: the backend's own requeue on 75 handles it."""
    from recording_backend import RecordingBackend
    from scse_dist.launch import retries

    class Requeuing(RecordingBackend):
        requeues = True

        def requeue(self, job_id: str) -> None:
            self.calls.append(("requeue", job_id))

        def current_start(self) -> int:
            return 0

    backend = Requeuing(current="9")
    monkeypatch.setattr(retries, "current_backend", lambda: (backend, "9"))
    logs = tmp_path / "runs" / "r" / "logs"
    assert not retries.is_crash(EXIT_TEMPFAIL)
    retries.after_failure(logs, 2, EXIT_TEMPFAIL, 0, retries.CrashWatch())
    assert backend.calls == [] and not logs.exists()
    retries.after_failure(logs, 2, 1, 0, retries.CrashWatch())  # a crash: decided and requeued
    assert backend.calls == [("requeue", "9")] and (logs / retries.RECORD_NAME).is_file()


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_second_training_into_a_busy_run_dir_is_refused_and_changes_nothing(
        tmp_path, tiny_config, user_env):
    """A first scse-train writes runs/tiny and is frozen (SIGSTOP) once it has saved, if possible
    in the middle of a save; the same command again exits 75 with one line naming the first and
    changes no file; the first, resumed (SIGCONT), finishes with exit 0, every checkpoint it had
    saved keeps its sha256, and every checkpoint verifies against its manifest."""
    steps, every = 40, 5
    config = tiny_config(tmp_path, f"train.max_steps={steps}", f"train.checkpoint.every={every}",
                         "train.checkpoint.keep=100", "train.log_every=1")
    run_dir = tmp_path / "runs" / "tiny"
    ckpts = run_dir / "checkpoints"
    cmd = console_script("scse-train") + ["--config", config]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=user_env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not (run_dir / LOCK_NAME).is_file() or not list(ckpts.glob("step-*")):
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.01)
        mid_save = time.time() + 10  # best effort: freeze it while a save is in flight
        while not list(ckpts.glob(".tmp-step-*")) and time.time() < mid_save:
            assert first.poll() is None, first.communicate()
            time.sleep(0.002)
        first.send_signal(signal.SIGSTOP)
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == first.pid
        before, hashes = listing(run_dir), tree_hashes(run_dir)
        saved = {k: v for k, v in hashes.items() if k.startswith("checkpoints/step-")}
        second = subprocess.run(cmd, cwd=tmp_path, env=user_env, text=True, capture_output=True,
                                timeout=300)
        assert (listing(run_dir), tree_hashes(run_dir)) == (before, hashes)  # nothing touched
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 75, second.stderr[-3000:]
    line, = second.stderr.splitlines()
    assert line.startswith(f"scse-train: busy: {run_dir} is being written by another process "
                           f"(host {socket.gethostname()}, pid {first.pid}, Slurm job none, "
                           "heartbeat ")
    assert first.returncode == 0, err[-3000:]
    after = tree_hashes(run_dir)
    assert {k: after.get(k) for k in saved} == saved  # the checkpoints saved before: unchanged
    tags = sorted(p.name for p in ckpts.glob("step-*"))
    assert tags == [f"step-{s:07d}" for s in range(every, steps + 1, every)]
    verify = subprocess.run(console_script("scse-ckpt") + ["verify", str(run_dir)],
                            env=user_env, text=True, capture_output=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "kind" not in r] == list(range(1, steps + 1))
    assert not (run_dir / LOCK_NAME).exists() and not list(run_dir.rglob(".tmp-*"))


@pytest.mark.slow
def test_every_rank_of_a_second_training_exits_75_and_none_waits(tmp_path, tiny_config,
                                                                 subprocess_env, live_pid):
    """Two ranks start into a run dir another process holds: rank 0 alone asks the lock, and
    both ranks stop with its one line and exit 75 (none waits for a peer that left)."""
    from train_procs import train_ranks

    config = tiny_config(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    data = foreign_lock(run_dir, live_pid)
    results = train_ranks(config, subprocess_env, timeout=240)
    assert [r.returncode for r in results] == [75, 75], results[0].tail() + results[1].tail()
    for result in results:
        line, = result.stderr.splitlines()
        assert line.startswith(f"scse-train: busy: {run_dir} is being written by another process")
        assert f"pid {live_pid}" in line
    assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME]
    assert (run_dir / LOCK_NAME).read_bytes() == data
