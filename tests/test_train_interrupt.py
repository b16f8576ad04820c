"""Ctrl-C during training, typed at a real terminal (a pty): the step in flight is saved and the
run exits 75 like a preemption; a second Ctrl-C stops at once (130) and saves nothing."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from train_procs import REPO, TRAIN, read_metrics

pytestmark = pytest.mark.slow
CTRL_C = b"\x03"  # the terminal's interrupt character: SIGINT to its foreground process group


class Terminal:
    """`python args...` on a pseudo-terminal, as in a user's shell."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec the command with the pty as its terminal
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, *args], env)
        self.output = b""

    def _read(self, seconds: float) -> bool:
        """Read what arrives within `seconds`; False at end of output."""
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        self.output += chunk
        return bool(chunk)

    def wait_for(self, text: bytes, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline and self._read(1.0), \
                f"no {text!r} in:\n{self.output.decode(errors='replace')[-3000:]}"

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_status(self, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while self._read(0.5) and time.monotonic() < deadline:
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def start(config: str, env: dict, stall_s: float) -> Terminal:
    env = dict(env, SCSE_FAULT="stall@3", SCSE_FAULT_STALL_S=str(stall_s))
    term = Terminal([TRAIN, "--config", config], env)
    term.wait_for(b"fault: stalling step 3")  # step 3 is in flight
    return term


@pytest.mark.parametrize("workers", [0, 1])  # a data-loader worker gets the terminal's SIGINT too
def test_ctrl_c_saves_the_step_in_flight_exits_75_and_the_rerun_resumes(tmp_path, tiny_config,
                                                                        subprocess_env, workers):
    config = tiny_config(tmp_path, "train.max_steps=8", "train.log_every=1",
                         "train.checkpoint.every=100", f"data.num_workers={workers}")
    term = start(config, subprocess_env, stall_s=3)
    term.type(CTRL_C)
    status = term.exit_status()
    out = term.output.decode(errors="replace")
    assert status == 75, out[-3000:]
    assert out.count("scse-train: Ctrl-C: finishing the step in flight, saving a checkpoint") == 1
    assert "preempted by SIGINT: saved step-0000003 after step 3" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-0000003"
    assert not (ckpts.parent / ".lock").exists()  # the run dir's lock released at exit 75

    rerun = subprocess.run([sys.executable, TRAIN, "--config", config], cwd=REPO,
                           env=subprocess_env, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "at step 3 (data stream and RNG restored)" in rerun.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "tiny")] == list(range(1, 9))


def test_a_second_ctrl_c_stops_at_once_with_one_line_and_saves_nothing(tmp_path, tiny_config,
                                                                       subprocess_env):
    config = tiny_config(tmp_path, "train.max_steps=8", "train.checkpoint.every=100")
    term = start(config, subprocess_env, stall_s=120)
    term.type(CTRL_C)
    term.wait_for(b"Ctrl-C again stops at once without saving")
    pressed = time.monotonic()
    term.type(CTRL_C)
    status = term.exit_status()
    out = term.output.decode(errors="replace")
    assert status == 130, out[-3000:]
    assert time.monotonic() - pressed < 10  # not after the 120 s step
    assert out.count("scse-train: interrupted again: stopped without saving") == 1
    assert "Traceback" not in out
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists() or \
        not list((tmp_path / "runs" / "tiny" / "checkpoints").glob("step-*"))
    assert not (tmp_path / "runs" / "tiny" / ".lock").exists()  # released before os._exit
