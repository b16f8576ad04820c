"""scse_dist.progress, scse_dist.threads and cli_main's Ctrl-C line: the shared facilities every
command uses for progress, CPU threads and interruption."""

from __future__ import annotations

import io
import time

import pytest

from scse_dist.cli_errors import EXIT_INTERRUPTED, Interrupted, cli_main
from scse_dist.progress import Progress, eta_seconds, format_duration
from scse_dist.threads import choose_threads


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_duration_and_eta():
    assert format_duration(7) == "0:07"
    assert format_duration(310) == "5:10"
    assert format_duration(3723) == "1:02:03"
    assert format_duration(None) == "?"
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(25, 100, 10.0) == pytest.approx(30.0)


def test_progress_off_a_terminal_prints_periodic_lines_and_one_at_the_end():
    out = _Pipe()
    with Progress(total=10, desc="lambada T=1,8", unit="passage", stream=out, every_s=0.05) as bar:
        bar.update(4)  # before every_s has passed: no line yet
        assert out.getvalue() == ""
        time.sleep(0.06)
        bar.set_postfix(ppl="12.5")
        bar.update(2)
        bar.update(4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("lambada T=1,8: 6/10 passage, ")
    assert ", ETA " in lines[0] and lines[0].endswith(", ppl 12.5")
    assert lines[1].startswith("lambada T=1,8: 10/10 passage, ") and "ETA 0:00" in lines[1]


def test_progress_on_a_terminal_draws_a_bar_and_disabled_prints_nothing():
    term = _Terminal()
    with Progress(total=3, desc="eval", stream=term) as bar:
        bar.update(3)
    assert "eval" in term.getvalue() and "3/3" in term.getvalue()
    quiet = _Terminal()
    with Progress(total=3, desc="eval", stream=quiet, enabled=False) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("cpus,load,procs,env,want", [
    (2, 0.0, 1, {}, 2),          # alone: every core
    (2, 1.0, 1, {}, 1),          # one other busy process: the free core only
    (2, 3.7, 1, {}, 1),          # overloaded: still one
    (16, 2.2, 4, {}, 3),         # 4 ranks share the 14 free cores
    (2, 0.0, 1, {"OMP_NUM_THREADS": "3"}, 3),  # the user's choice wins
])
def test_choose_threads(cpus, load, procs, env, want):
    assert choose_threads(cpus, load, procs, env) == want


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    @cli_main("scse-x")
    def plain(argv=None):
        raise KeyboardInterrupt

    @cli_main("scse-x")
    def kept(argv=None):
        raise Interrupted("wrote 3 of 10 batches to out.json")

    assert plain([]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "scse-x: interrupted"
    assert kept([]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == \
        "scse-x: interrupted: wrote 3 of 10 batches to out.json"
