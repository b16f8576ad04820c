"""The write rule (scse_dist.atomic; docs/data.md): a command writes only new files or files it
made itself, and a failed one leaves every file around it as it was. Issue 38's cases 1 and 3, run
as a user would, from a folder outside the checkout: the exit status, the one line, and a
listing (every file's sha256, every folder) before and after."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT, console_script
from scse_dist.data.cli import main

NO_INPUT = 66  # scse_dist.cli_errors


def _listing(root: Path) -> dict[str, str]:
    """Every path under `root`: a file's sha256, or "dir" for a folder."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


@pytest.fixture
def web(tmp_path, tiny_data) -> Path:
    """An experiment folder outside the checkout holding a user's corpus: data/web/shards and the
    tokenizer they were written with, data/web/tokenizer.json (days of work)."""
    shutil.copytree(tiny_data["path"], tmp_path / "data" / "web" / "shards")
    shutil.copyfile(tiny_data["tokenizer"], tmp_path / "data" / "web" / "tokenizer.json")
    return tmp_path


@pytest.mark.parametrize("build_here, says", [
    # case 1: the build comes from the base config; the child's paths are not where it builds
    (False, "scse-train: error: data.path 'data/web/shardz' (in bad.yaml) holds no shards, and "
            f"data.build=stdlib_docs in {REPO_ROOT}/configs/tiny-cpu.yaml builds only into the "
            "data.path and data.tokenizer that file names; check the path, or set "
            "data.build=stdlib_docs where the path is set to build there"),
    # the child asks for the build itself: it still writes over no tokenizer it did not make
    (True, "scse-train: error: data.tokenizer 'data/web/tokenizer.json' exists, and no "
           "index.json of data.build=stdlib_docs at data.path 'data/web/shardz' names it as the "
           "tokenizer the build made; the build writes over nothing it did not make: check "
           "data.path and data.tokenizer, or remove that file to build both again"),
])
def test_a_build_never_writes_over_a_users_tokenizer(web, user_env, build_here, says):
    data = {"path": "data/web/shardz", "tokenizer": "data/web/tokenizer.json",
            **({"build": "stdlib_docs"} if build_here else {})}
    (web / "bad.yaml").write_text(f"base: {REPO_ROOT}/configs/tiny-cpu.yaml\n"
                                  f"data: {json.dumps(data)}\n")
    before = _listing(web)
    proc = _run([*console_script("scse-train"), "--config", "bad.yaml", "train.max_steps=5"],
                web, user_env)
    assert (proc.returncode, proc.stderr) == (NO_INPUT, says + "\n")
    assert _listing(web) == before


@pytest.mark.parametrize("processes", ["1", "2"])
def test_failed_shards_leave_an_existing_output_and_make_no_folder(web, user_env, processes):
    """Case 3: a glob that matches nothing, into existing shards and into a new folder."""
    shutil.copyfile(web / "data" / "web" / "tokenizer.json", web / "tok.json")
    shutil.copytree(web / "data" / "web" / "shards", web / "existing_shards")
    before = _listing(web)
    for out in ("existing_shards", "new/shards"):
        proc = _run([*console_script("scse-data"), "shards", "--input", "nocorpus/*.jsonl",
                     "--tokenizer", "tok.json", "--out", out, "--processes", processes],
                    web, user_env)
        assert proc.returncode == NO_INPUT
        assert proc.stderr.splitlines()[0] == \
            "scse-data: error: input 'nocorpus/*.jsonl' matches no file"
        assert len(proc.stderr.splitlines()) == 1
        assert _listing(web) == before  # the index kept, no new/, no parts/, no .tmp-*


def test_shards_replace_their_own_output_and_refuse_a_users_file(tmp_path, tiny_data, capsys):
    """A rerun into shards replaces them (index.json last); a folder holding a file of that name
    that scse-data did not write is refused before anything moves."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} on looped models"}) + "\n"
                           for i in range(50)))
    out = tmp_path / "out"
    args = ["shards", "--input", str(src), "--tokenizer", tiny_data["tokenizer"],
            "--progress-every", "0", "--out"]
    assert main([*args, str(out)]) == 0
    first = _listing(out)
    assert main([*args, str(out)]) == 0
    assert _listing(out) == first and "50 documents" in capsys.readouterr().out
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train-000000.tar").write_text("a user's file")
    before = _listing(tmp_path)
    assert main([*args, str(mine)]) == NO_INPUT
    assert capsys.readouterr().err == (
        f"scse-data: error: {mine}: train-000000.tar exists and this stack did not write it; "
        "nothing was written: give another output, or move it away\n")
    assert _listing(tmp_path) == before


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """The quickstart build writes its tokenizer only once its shards are in place."""
    from scse_dist.data import quickstart

    docs = [f"Module {i} docstring about loops and state {i % 5}." * 20 for i in range(300)]
    monkeypatch.setattr(quickstart, "stdlib_documents", lambda: iter(docs))

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(quickstart, "write_shards", no_space)
    with pytest.raises(OSError, match="(?i)no space left"):
        quickstart.build_stdlib_corpus(str(tmp_path / "q" / "shards"),
                                       str(tmp_path / "q" / "tokenizer.model"), 300, 0.05)
    assert list(tmp_path.iterdir()) == []  # no tokenizer, no shards, no q/, no temporary file


def test_malformed_jsonl_says_at_column_once(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "tab\there"}\n')
    assert main(["tokenizer", "--input", str(src), "--vocab-size", "300", "--out",
                 str(tmp_path / "t.model")]) == 65
    assert capsys.readouterr().err == (f"scse-data: error: {src}:2: not valid JSON (Invalid "
                                       "control character at column 14)\n")


def test_a_failed_export_leaves_the_old_export(tmp_path, monkeypatch):
    """An export is replaced whole or not at all: never new weights beside an old config."""
    import torch

    import scse_dist.hf
    from conftest import tiny_cfg
    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.model import LoopedLM

    cfg = tiny_cfg()
    save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path / "export"))
    before = _listing(tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(scse_dist.hf, "write_hf_files", no_space)  # the last files it writes
    torch.manual_seed(1)
    with pytest.raises(OSError, match="(?i)no space left"):
        save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(tmp_path / "export"))
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_report_leaves_the_old_report(tmp_path, monkeypatch, existing):
    """scse-report writes report.md and its plots together, or nothing (no empty folder)."""
    from scse_dist.eval import report

    out = tmp_path / "eval"
    if existing:
        out.mkdir()
        (out / "report.md").write_text("the report of yesterday")
        (out / "heldout.json").write_text("{}")  # results the report was made from

    def broken(results, path):
        Path(path).write_bytes(b"half a PNG")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "collect", lambda run_dirs: [])
    monkeypatch.setattr(report, "frontier_plot", broken)
    before = _listing(tmp_path)
    with pytest.raises(OSError, match="(?i)no space left"):
        report.write_report([str(tmp_path / "runs" / "a")], out)
    assert _listing(tmp_path) == before


def test_a_failed_merge_keeps_the_shards_and_the_parts(tmp_path, tiny_data, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} on looped models"}) + "\n"
                           for i in range(60)))
    out = str(tmp_path / "out")
    args = ["shards", "--input", str(src), "--tokenizer", tiny_data["tokenizer"], "--out", out,
            "--progress-every", "0"]
    assert main(args) == 0  # the shards a merge would replace
    for k in range(2):
        assert main([*args, "--part", f"{k}/2"]) == 0
    part = tmp_path / "out" / "parts" / "part-00001-of-00002" / "train.tokens"
    part.write_bytes(part.read_bytes()[:10])
    before = _listing(tmp_path)
    capsys.readouterr()
    assert main(["merge", out]) == 65
    assert capsys.readouterr().err == (
        f"scse-data: error: {part.parent}: train.tokens or train.lens is shorter than part.json "
        "says; rerun this part\n")
    assert _listing(tmp_path) == before
