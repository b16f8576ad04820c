"""Out of space (ENOSPC, EDQUOT, EFBIG) at the writers of scse_dist.atomic and metrics.jsonl: a
NoSpaceError naming the path and the free space, nothing partial left in place of a file, and
exit 74 with one line at a command. Whole commands: tests/test_train_no_space.py."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import resource
import shutil

import pytest

from scse_dist import atomic
from scse_dist.atomic import (
    NO_SPACE_FAULT_ENV,
    NoSpaceError,
    atomic_write_text,
    is_no_space,
    output_dir,
)
from scse_dist.cli_errors import EXIT_NO_SPACE, cli_main
from scse_dist.train.metrics import MetricsLogger
from scse_dist.train.metrics_config import WandbConfig

FREE = re.compile(r": \d+(\.\d)? (B|kB|MB|GB|TB) free on that file system \(a full disk, a quota "
                  r"or a file-size limit\); free space and rerun the same command$")


@pytest.fixture
def inject(monkeypatch):
    """inject("PATTERN[@N]"): the Nth write matching PATTERN fails with ENOSPC."""
    def set_fault(spec: str) -> None:
        monkeypatch.setenv(NO_SPACE_FAULT_ENV, spec)
        monkeypatch.setattr(atomic, "_injected_count", 0)
    return set_fault


def test_a_file_that_does_not_fit_leaves_the_old_one_and_names_path_and_free_space(tmp_path,
                                                                                   inject):
    target = tmp_path / "results.json"
    target.write_text("old")
    inject("*/results.json@2")  # the first matching write fits, the second does not
    atomic_write_text(tmp_path / "other" / "results.json", "first")
    with pytest.raises(NoSpaceError) as err:
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "results.json"]  # no .tmp-*
    assert str(err.value).startswith(f"no space left writing {target}: ")
    assert FREE.search(str(err.value)) and err.value.path == str(target)


def test_the_error_comes_back_whole_from_a_worker_process(tmp_path):
    error = NoSpaceError.at(tmp_path / "part-0" / "train.tokens")
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.path, back.errno) == \
        (NoSpaceError, str(error), error.path, errno.ENOSPC)


def test_a_new_file_that_does_not_fit_leaves_no_folder(tmp_path, inject):
    inject("*.json")
    with pytest.raises(NoSpaceError):
        atomic_write_text(tmp_path / "new" / "deep" / "a.json", "x")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_does_not_fit_leaves_the_old_one(tmp_path, inject):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "index.json").write_text("old index")
    inject(f"{out}")
    with pytest.raises(NoSpaceError, match=f"^no space left writing {out}: "):
        with output_dir(str(out), lambda _: True, "index.json") as tmp:
            (tmp_path / os.path.basename(tmp) / "index.json").write_text("new index")
    assert [p.name for p in tmp_path.iterdir()] == ["shards"]
    assert [(p.name, p.read_text()) for p in out.iterdir()] == [("index.json", "old index")]


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (OSError(errno.EFBIG, "File too large"), True),
    # torch.save wraps the failed write in its own RuntimeError, without the errno
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), True),
    (RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed "
                  "writing file data/0: file write failed"), True),
    # safetensors' SafetensorError names the OS error by number
    (Exception("Error while serializing: I/O error: File too large (os error 27)"), True),
    (OSError(errno.ENOENT, "No such file or directory"), False),
    (Exception("Error while deserializing: I/O error: No such file (os error 2)"), False),
    (RuntimeError("[enforce fail at inline_container.cc:300] . file not found"), False),
])
def test_which_errors_are_out_of_space(error, full):
    assert is_no_space(error) is full
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = error
    assert is_no_space(wrapped) is full


def test_a_command_says_one_line_with_the_free_space_and_exits_74(tmp_path, capsys):
    path = tmp_path / "out" / "x.bin"

    @cli_main("scse-x")
    def raw(argv):  # an OSError no writer converted: its filename is named, with the free space
        raise OSError(errno.EFBIG, "File too large", str(path))

    @cli_main("scse-x")
    def typed(argv):
        raise NoSpaceError.at(path)

    for main in (raw, typed):
        assert main([]) == EXIT_NO_SPACE == 74
        err = capsys.readouterr().err
        assert err.startswith(f"scse-x: no space left writing {path}: ") and \
            err.count("\n") == 1 and FREE.search(err.rstrip("\n"))
        free = shutil.disk_usage(tmp_path).free
        assert f"{free / 1e9:.1f} GB" in err or f"{free / 1e6:.1f} MB" in err or \
            f"{free / 1e12:.1f} TB" in err


def _logger(run_dir) -> MetricsLogger:
    return MetricsLogger(str(run_dir), True, WandbConfig(enabled=False), "t", {})


def test_a_metrics_row_that_does_not_fit_leaves_the_rows_before_it(tmp_path, inject):
    inject("*/metrics.jsonl@2")
    logger = _logger(tmp_path)
    logger.write({"step": 1, "loss": 2.0})
    with pytest.raises(NoSpaceError, match=f"writing {tmp_path / 'metrics.jsonl'}: "):
        logger.write({"step": 2, "loss": 1.5})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_metrics_row_cut_by_a_file_size_limit_is_cut_off_whole(tmp_path):
    logger = _logger(tmp_path)
    logger.write({"step": 1})
    size = (tmp_path / "metrics.jsonl").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(NoSpaceError):
            logger.write({"step": 2, "text": "x" * 100})  # 20 bytes fit: written, then cut
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1}]
