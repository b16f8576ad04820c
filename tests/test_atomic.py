"""atomic_write: the new content replaces the old in one step; a failed write changes nothing."""

import os

import pytest

from scse_dist.atomic import atomic_write, atomic_write_text


def test_replaces_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "latest"
    atomic_write_text(target, "step-0000001")
    atomic_write_text(target, "step-0000002")
    assert target.read_text() == "step-0000002"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")

    def half_write(tmp):
        tmp.write_text("ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_write)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_output_dir_adds_to_other_files_and_a_failure_leaves_no_folder(tmp_path):
    from pathlib import Path

    from scse_dist.atomic import output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with output_dir(str(out), lambda url: False, "index.json") as tmp:
        (Path(tmp) / "a.bin").write_bytes(b"x")
        (Path(tmp) / "index.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "index.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(RuntimeError, match="half way"):
        with output_dir(str(tmp_path / "new" / "deep" / "out"), lambda url: False, "x") as tmp:
            (Path(tmp) / "x").write_text("half")
            raise RuntimeError("half way")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no new/, no .tmp-*


def test_output_dir_removes_only_leftovers_whose_writer_is_provably_gone(tmp_path):
    """`.tmp-NAME.HOST.PID` beside a published folder: removed when HOST is this host and PID is
    dead; kept when the process lives, when it ran on another host (a shared file system), or
    when the name carries no host."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from scse_dist.atomic import output_dir

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    here = socket.gethostname()
    names = {"dead here": f".tmp-out.{here}.{done.pid}",
             "alive here": f".tmp-out.{here}.{os.getppid()}",
             "dead elsewhere": f".tmp-out.node-elsewhere.{done.pid}",
             "no host": f".tmp-out.{done.pid}"}
    for name in names.values():
        (tmp_path / name).mkdir()
    with output_dir(str(tmp_path / "out"), lambda url: False, "x") as tmp:
        (Path(tmp) / "x").write_text("1")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["out", names["alive here"], names["dead elsewhere"], names["no host"]])
