"""atomic_write: the new content replaces the old in one step; a failed write changes nothing."""

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
