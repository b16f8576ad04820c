"""Commands that start others stop what they started (scse_dist.launch.children): a signal to the
parent reaches the child once, the parent waits for it, and nothing of it is left. Real processes:
a shell that traps the signal, then `scse-study --local` (SIGTERM) and `scse-launch --backend
local` (Ctrl-C at a terminal) on a tiny run, each stopped mid-step, exiting 75 with no process
left, and resumed by a rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from scse_dist.launch.children import StoppedBySignal, run_child, stop_on_signals


def wait_for(path: Path, text: str, timeout: float = 240,
             proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} before {text!r}"
        time.sleep(0.2)


def gone(pids: list[int]) -> list[int]:
    """Those of `pids` still running once the killed ones had time to die (a zombie runs
    nothing)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)  # reaped by init after their parent ended
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_signal_is_forwarded_once_waited_for_and_the_childs_group_is_cleared(tmp_path):
    pids = tmp_path / "pids"
    # the child traps SIGTERM (counting it) and leaves a background sleep in its group
    script = (f"trap 'echo term >> {tmp_path}/got; exit 75' TERM; sleep 600 & echo $$ $! > {pids}; "
              "wait")

    def signal_parent() -> None:
        deadline = time.monotonic() + 30
        while not (pids.is_file() and pids.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_parent, daemon=True).start()
    ended = run_child(["bash", "-c", script])
    assert (ended.status, ended.signal_name) == (75, "SIGTERM")
    assert (tmp_path / "got").read_text() == "term\n"  # once
    shell, sleeper = map(int, pids.read_text().split())
    assert gone([shell, sleeper]) == []  # the sleep its shell left behind was killed too
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the parent's handler is back


def test_without_a_child_a_signal_stops_the_work_in_progress():
    with pytest.raises(StoppedBySignal) as stopped:
        with stop_on_signals(lambda: "the evaluation of run x"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # interrupted by the handler
    assert (stopped.value.signal_name, stopped.value.status) == ("SIGINT", 75)
    assert str(stopped.value) == ("stopped by SIGINT during the evaluation of run x (it saved a "
                                  "checkpoint, rerun to resume)")


def _tiny_spec(tmp_path: Path, tiny_config) -> Path:
    base = tiny_config(tmp_path, "train.max_steps=6", "train.log_every=1",
                       "train.checkpoint.every=100")
    spec = {"name": "sig", "out": str(tmp_path / "studies"), "base": base, "seeds": [0],
            "variants": {"scse": {"overrides": {}}}, "evals": {"tasks": ["heldout"], "depths": [1]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.slow
def test_sigterm_to_a_local_study_saves_the_run_exits_75_leaves_nothing_and_a_rerun_resumes(
        tmp_path, tiny_config, user_env):
    spec = _tiny_spec(tmp_path, tiny_config)
    outside = tmp_path / "elsewhere"  # a directory outside the checkout
    outside.mkdir()
    env = dict(user_env, WANDB_MODE="disabled", SCSE_FAULT="stall@3", SCSE_FAULT_STALL_S="3")
    out, err = tmp_path / "study.out", tmp_path / "study.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "scse_dist.study.cli", str(spec), "--local"],
                                stdout=stdout, stderr=stderr, cwd=outside, env=env)
        wait_for(out, "fault: stalling step 3", proc=proc)  # step 3 in flight
        started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=300)
    text = err.read_text()
    run = tmp_path / "studies" / "sig" / "scse" / "scse-seed0"
    assert status == 75, text[-3000:]
    assert text.rstrip().splitlines()[-1] == (f"scse-study: stopped by SIGTERM during training "
                                              f"{run} (it saved a checkpoint, rerun to resume)")
    assert "preempted by SIGTERM: saved step-0000003 after step 3" in text + out.read_text()
    assert started and gone(started) == []  # the trainer and anything it started
    again = subprocess.run([sys.executable, "-m", "scse_dist.study.cli", str(spec), "--local"],
                           capture_output=True, text=True, cwd=outside,
                           env=dict(user_env, WANDB_MODE="disabled"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stdout and "resumed" in again.stdout + again.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"kind"' not in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # 1-3 before the signal, 4-6 after: nothing repeated
    assert (run / "eval" / "heldout.json").is_file()


@pytest.mark.slow
def test_ctrl_c_to_a_local_backend_launch_reaches_training_once_and_exits_75(tmp_path, tiny_config,
                                                                              user_env):
    from test_train_interrupt import CTRL_C, Terminal

    config = tiny_config(tmp_path, "train.max_steps=6", "train.log_every=1",
                         "train.checkpoint.every=100", "eval.tasks=[heldout]")
    env = dict(user_env, WANDB_MODE="disabled", SCSE_FAULT="stall@3", SCSE_FAULT_STALL_S="3")
    term = Terminal(["-m", "scse_dist.launch.scheduler", config, "--backend", "local"], env)
    logs = tmp_path / "runs" / "tiny" / "logs"
    deadline = time.monotonic() + 240
    while not any("fault: stalling step 3" in p.read_text(errors="replace")
                  for p in logs.glob("*.out")):
        assert time.monotonic() < deadline, term.output.decode(errors="replace")
        time.sleep(0.2)
    started = [p.pid for p in psutil.Process(term.pid).children(recursive=True)]
    term.type(CTRL_C)
    status = term.exit_status()
    out = term.output.decode(errors="replace")
    (log,) = logs.glob("*.err")
    assert status == 75, out[-3000:]
    assert "scse-launch: stopped by SIGINT during local job" in out and "rerun to resume" in out
    training = log.read_text() + log.with_suffix(".out").read_text()
    # one Ctrl-C reached the trainer, through two parents: it saved (a second would stop it at once)
    assert training.count("scse-train: Ctrl-C: finishing the step in flight") == 1, training
    assert "preempted by SIGINT: saved step-0000003 after step 3" in training
    assert started and gone(started) == []
