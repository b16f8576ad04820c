"""Crash retries' decisions (scse_dist.launch.retries) on a real run dir: which statuses are
crashes, the crash line, one decision per start, and the stops (the same failure twice, the
retries used). tests/test_slurm_retries.py runs them on a real Slurm with a fault in one rank."""

import json

import pytest

from scse_dist.config import load_config
from scse_dist.launch.retries import CrashWatch, decide, failure_of, is_crash, read_record
from scse_dist.train.faults import FaultInjector
from scse_dist.typed_yaml import ConfigError


def crashed(line: str) -> CrashWatch:
    watch = CrashWatch()
    watch(line + "\n")
    return watch


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-0000005")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n{"step": 5, "loss": 5.9}\n')
    return run


def test_crashes_are_what_a_retry_may_get_past():
    assert [s for s in (0, 1, 2, 3, 4, 65, 66, 74, 75, 130, 137, -9, -11) if is_crash(s)] == \
        [1, 137, -9, -11]


def test_the_crash_line_gives_rank_step_and_signature(run, capsys):
    line = "scse-train: rank 1 crashed after step 7: RuntimeError: fault: crash at step 8"
    watch = crashed(line)
    assert capsys.readouterr().err == line + "\n"  # passed on as it came
    f = failure_of(1, 0, watch, run, "42", 0)
    assert (f.rank, f.step, f.signature, f.latest_checkpoint) == \
        (1, 7, "RuntimeError: fault: crash at step 8", "step-0000005")
    addressed = crashed("scse-train: rank 0 crashed after step 3: ValueError: <obj at 0x7f3a12>")
    assert failure_of(1, 0, addressed, run, "42", 0).signature == "ValueError: <obj at 0x?>"
    peer = crashed("scse-train: rank 0 crashed after step 7: RuntimeError: [pair.cc:553] "
                   "Connection closed by peer [127.0.0.1]:11425, host:2950")
    assert failure_of(1, 0, peer, run, "42", 0).signature == \
        "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:?, host:2950"
    # no crash line (killed): the status, and the last logged step
    silent = failure_of(-9, 1, CrashWatch(), run, "42", 0)
    assert (silent.rank, silent.step, silent.signature) == (1, 5, "killed by SIGKILL")
    assert failure_of(137, 1, CrashWatch(), run, "42", 0).signature == "exit 137"


def test_one_decision_per_start_then_the_same_failure_twice_stops(run):
    logs = run / "logs"
    watch = crashed("scse-train: rank 1 crashed after step 7: RuntimeError: boom")
    retry, line = decide(logs, failure_of(1, 1, watch, run, "42", 0), max_retries=2)
    assert retry and line == (
        "scse-launch: training crashed on rank 1 after step 7 (exit 1: RuntimeError: boom): "
        "retry 1 of 2, requeueing job 42; it resumes from the latest verified checkpoint "
        "(step-0000005)")
    # the dead peer's own failure in the same start: decided already, nothing recorded
    peer = crashed("scse-train: rank 0 crashed after step 7: RuntimeError: Connection closed")
    assert decide(logs, failure_of(1, 0, peer, run, "42", 0), max_retries=2) is None
    assert len(read_record(logs / "retries.json")) == 1

    retry, line = decide(logs, failure_of(1, 1, watch, run, "42", 1), max_retries=2)
    assert not retry and line.endswith(
        "(exit 1: RuntimeError: boom): the same failure after the same step as start 1 of job 42; "
        f"not retrying, it would fail again ({logs / 'retries.json'})")
    starts = json.loads((logs / "retries.json").read_text())["starts"]
    assert [(s["job"], s["start"], s["rank"], s["step"], s["decision"]) for s in starts] == \
        [("42", 0, 1, 7, "retry"), ("42", 1, 1, 7, "stop")]


def test_bad_input_on_one_rank_decides_its_start_so_a_peers_crash_is_not_retried(run):
    logs = run / "logs"
    stop, line = decide(logs, failure_of(65, 0, CrashWatch(), run, "42", 0), max_retries=2)
    assert not stop and line == ("scse-launch: training stopped on rank 0 with exit 65 (bad input "
                                 "data): not retrying, a rerun would fail the same way")
    # rank 1 lost its peer in a collective: a crash, but the start is decided already
    peer = crashed("scse-train: rank 1 crashed after step 5: RuntimeError: Connection closed")
    assert decide(logs, failure_of(1, 1, peer, run, "42", 0), max_retries=2) is None
    assert [s["decision"] for s in read_record(logs / "retries.json")] == ["stop"]


def test_no_space_is_not_retried_and_the_line_says_to_free_space(run):
    logs = run / "logs"
    retry, line = decide(logs, failure_of(74, 0, CrashWatch(), run, "42", 0), max_retries=2)
    assert not retry and line == (
        "scse-launch: training stopped on rank 0 with exit 74 (no space left: a full disk, a quota "
        "or a file-size limit): not retrying, free space, then submit the same job again: it "
        "resumes from the last checkpoint")
    assert [s["decision"] for s in read_record(logs / "retries.json")] == ["stop"]


def test_different_failures_are_retried_until_max_retries(run):
    logs = run / "logs"

    def at(step: int, start: int, job: str = "42", max_retries: int = 2):
        watch = crashed(f"scse-train: rank 0 crashed after step {step}: OSError-like: flaky")
        return decide(logs, failure_of(1, 0, watch, run, job, start), max_retries)

    assert at(7, 0)[0] and at(9, 1)[0]  # another step: another failure
    retry, line = at(11, 2)
    assert not retry and "not retrying, launch.max_retries=2 and 2 retries used" in line
    assert at(7, 0, job="43")[0]  # a new submission counts afresh
    retry, line = at(7, 0, job="44", max_retries=0)
    assert not retry and "not retrying, launch.max_retries=0 (" in line


def test_max_retries_is_checked(tmp_path, capfd):
    assert load_config(None, []).launch.max_retries == 2
    with pytest.raises(ConfigError, match="launch.max_retries: must be >= 0, got -1"):
        load_config(None, ["launch.max_retries=-1"])
    # its old name, train.start.max_retries (the launcher alone reads it), loads with a notice
    import scse_dist.typed_yaml as typed_yaml

    typed_yaml._noticed.discard("train.start.max_retries")  # once per process: this test's own
    (tmp_path / "old.yaml").write_text("train: {start: {max_retries: 0}}\n")
    assert load_config(tmp_path / "old.yaml").launch.max_retries == 0
    assert "train.start.max_retries is now launch.max_retries" in capfd.readouterr().err


def test_crash_faults_raise_at_their_step_and_crash_once_only_at_the_first_start(monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    every, once = FaultInjector(1, "crash@3:rank1"), FaultInjector(0, "crash_once@3")
    every.step_started(2)
    for injector in (every, once):
        with pytest.raises(RuntimeError, match="^fault: crash at step 3$"):
            injector.step_started(3)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    once.step_started(3)  # a requeued start gets past it
    with pytest.raises(RuntimeError):
        every.step_started(3)
    FaultInjector(0, "crash@3:rank1").step_started(3)  # another rank's
