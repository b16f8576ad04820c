"""`scse-data shards` in parts (`--part K/N`, then `scse-data merge`) and over local processes
(`--processes N`): the output directory is byte for byte what one process writes, every file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_VOCAB, console_script, sigint_default, tiny_documents
from scse_dist.data.cli import main

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

DOCS = tiny_documents(500, seed=5)
LAYOUT = ["--heldout-fraction", "0.1", "--sample-tokens", "700", "--shard-mb", "0.02",
          "--progress-every", "0"]


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Three JSONL files and a parquet file of several row groups (8 units of unequal size),
    their tokenizer and the shards one process writes from them."""
    root = tmp_path_factory.mktemp("parts")
    inputs = []
    for i, (a, b) in enumerate([(0, 60), (60, 200), (200, 230)]):
        path = root / f"docs-{i}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[a:b]))
        inputs.append(str(path))
    pq.write_table(pa.table({"text": DOCS[230:]}), root / "rest.parquet", row_group_size=50)
    inputs.append(str(root / "rest.parquet"))
    tok = str(root / "tok.model")
    assert main(["tokenizer", "--input", *inputs, "--vocab-size", str(TINY_VOCAB),
                 "--out", tok]) == 0
    single = root / "single"
    assert main(["shards", "--input", *inputs, "--tokenizer", tok, "--out", str(single),
                 *LAYOUT]) == 0
    tree = _tree(single)
    index = json.loads(tree["index.json"])
    # the case worth testing: several shards per split, shards of several samples
    assert len(index["splits"]["train"]) >= 3 and len(index["splits"]["heldout"]) >= 1
    assert max(e["samples"] for e in index["splits"]["train"]) >= 2
    return {"inputs": inputs, "tok": tok, "tree": tree, "root": root}


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_parts_then_merge_are_byte_identical_to_one_process(corpus, tmp_path, capsys, parts):
    out = tmp_path / "out"
    for k in reversed(range(parts)):  # any order: the merge goes by part number
        assert main(["shards", "--input", *corpus["inputs"], "--tokenizer", corpus["tok"],
                     "--out", str(out), *LAYOUT, "--part", f"{k}/{parts}"]) == 0
        assert f"part {k}/{parts}: " in capsys.readouterr().out
    assert not (out / "index.json").exists()
    assert main(["merge", str(out)]) == 0
    assert f"merged {out}: 500 documents" in capsys.readouterr().out
    assert _tree(out) == corpus["tree"]  # every file, index.json included; parts/ removed


def test_merge_refuses_missing_or_mixed_parts(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["shards", "--input", *corpus["inputs"], "--tokenizer", corpus["tok"], "--out",
            str(out), *LAYOUT]
    assert main(["merge", str(out)]) == 66
    assert "no finished part to merge" in capsys.readouterr().err
    assert main([*args, "--part", "0/3"]) == 0
    assert main([*args, "--part", "2/3"]) == 0
    assert main(["merge", str(out)]) == 65
    assert capsys.readouterr().err.endswith(
        f"{out}/parts: parts [1] of 3 are missing or unfinished; run `scse-data shards ... "
        "--part K/3` for them\n")
    assert main([*args[:-len(LAYOUT)], "--sample-tokens", "900", "--progress-every", "0",
                 "--heldout-fraction", "0.1", "--shard-mb", "0.02", "--part", "1/3"]) == 0
    assert main(["merge", str(out)]) == 65
    assert "part 1 has sample_tokens 900, part 0 700; every part must run the same command" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*args, "--part", "3/3"])
    assert exc.value.code == 2 and "K must lie in 0..N-1" in capsys.readouterr().err


@pytest.mark.slow
def test_processes_run_the_parts_as_processes_with_the_same_bytes(corpus, tmp_path):
    out = tmp_path / "out"
    cmd = [*console_script("scse-data"), "shards", "--input", *corpus["inputs"], "--tokenizer",
           corpus["tok"], "--out", str(out), *LAYOUT, "--processes", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"shards {out} (3 processes): 500 documents" in done.stdout
    assert "scse-data merge" not in done.stdout  # it merged: no advice to
    assert _tree(out) == corpus["tree"]
    # a part that fails stops the command, naming the part, and writes nothing: no --out, no
    # parts/, no temporary folder
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    cmd = [*console_script("scse-data"), "shards", "--input", *corpus["inputs"], str(bad),
           "--tokenizer", corpus["tok"], "--out", str(tmp_path / "o2"), *LAYOUT,
           "--processes", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 65
    assert f"{bad}:2: no field 'text'" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        "scse-data: error: part 1/2 exited 65; the other parts were stopped"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out"]


def _running_with(marker: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


def _blocked_on_fifo(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("wait_for_partner", "fifo_open")
    except OSError:
        return False


@pytest.mark.slow
def test_ctrl_c_stops_every_part(corpus, tmp_path):
    # each part blocks reading a FIFO nobody writes: only the signal can end it
    fifos = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f in fifos:
        os.mkfifo(f)
    out = tmp_path / "ctrl-c-out"
    marker = str(fifos[0])  # on the command line of the command and of each part
    proc = subprocess.Popen([sys.executable, "-m", "scse_dist.data.cli", "shards", "--input",
                             *map(str, fifos), "--tokenizer", corpus["tok"], "--out", str(out),
                             "--processes", "2"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    deadline = time.time() + 60
    while len(_running_with(marker)) < 3 and time.time() < deadline:  # parent + 2 parts
        time.sleep(0.2)
    assert len(_running_with(marker)) == 3
    # the signal only once both parts block opening their FIFO (the kernel's wait_for_partner):
    # earlier, on a loaded machine, a part still importing could miss it
    while sum(_blocked_on_fifo(p) for p in _running_with(marker)) < 2 and \
            time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert proc.stderr is not None and "scse-data: interrupted" in proc.stderr.read()
    assert _running_with(marker) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]  # nothing written


def test_parts_and_merge_through_an_fsspec_url(corpus, capsys):
    # fsspec's in-memory filesystem stands in for object storage (s3://: the same calls)
    import fsspec

    fs = fsspec.filesystem("memory")
    for k in range(2):
        assert main(["shards", "--input", *corpus["inputs"], "--tokenizer", corpus["tok"],
                     "--out", "memory://bench/web", *LAYOUT, "--part", f"{k}/2"]) == 0
    assert main(["merge", "memory://bench/web"]) == 0
    got = {p.rsplit("/", 1)[-1]: fs.cat(p) for p in fs.find("/bench/web")}
    assert got == corpus["tree"]
    fs.rm("/bench", recursive=True)
