"""`scse-data import`: pre-tokenized ids (llm.c .bin, .npy, raw) into shards that read back byte
for byte, split as `scse-data shards` splits the same texts; bad files refused, nothing written."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT, TINY_VOCAB, tiny_documents
from scse_dist.data.cli import main
from scse_dist.data.shards import is_heldout, write_shards
from scse_dist.data.stream import TokenStream
from scse_dist.data.tokenizer import Tokenizer
from train_procs import read_metrics, run_trainer

HELDOUT = 0.2
LAYOUT = ["--heldout-fraction", str(HELDOUT), "--sample-tokens", "512"]


def write_bin(path: Path, ids: np.ndarray, magic: int = 20240520, version: int = 1,
              count: int | None = None) -> None:
    """A token file in llm.c's layout (dev/data/data_common.py's write_datafile)."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=np.uint16).tobytes())


@pytest.fixture(scope="module")
def corpus(tiny_data):
    """The texts, their ids, and the stream llm.c's fineweb.py writes: eos before each document."""
    tok = Tokenizer.load(tiny_data["tokenizer"])
    texts = tiny_documents(150, seed=7)
    docs = tok.encode_batch(texts)
    stream = np.concatenate([[tok.eos_id, *d] for d in docs]).astype(np.uint16)
    return {"tok": tok, "texts": texts, "docs": docs, "stream": stream,
            "tokenizer": tiny_data["tokenizer"]}


@pytest.fixture(scope="module")
def from_text(corpus, tmp_path_factory) -> Path:
    """The same texts through `scse-data shards`' writer: what an import must equal."""
    out = tmp_path_factory.mktemp("from_text") / "shards"
    write_shards(corpus["texts"], corpus["tok"], str(out), heldout_fraction=HELDOUT,
                 sample_tokens=512)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def same_shards(out: Path, reference: Path) -> None:
    """Every shard and table byte-identical; index.json equal but for its sources."""
    got, want = files_of(out), files_of(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        if name != "index.json":
            assert got[name] == want[name], name
    index, ref = json.loads(got["index.json"]), json.loads(want["index.json"])
    assert {**index, "sources": None} == {**ref, "sources": None}
    return index


def run(*argv: str) -> int:
    return main(["import", *argv])


def test_bin_import_reads_back_byte_exact_through_the_training_stream(corpus, from_text,
                                                                      tmp_path, capsys):
    """Two .bin files cut inside a document (as fineweb.py cuts its shards): the documents, split
    at the eos and joined across the cut, come back token for token through TokenStream, the
    held-out ones those whose text hashes under the fraction, the shards the very bytes
    `scse-data shards` writes from the texts."""
    stream, tok = corpus["stream"], corpus["tok"]
    cut = len(stream) // 2
    assert stream[cut] != tok.eos_id and stream[cut - 1] != tok.eos_id  # inside a document
    write_bin(tmp_path / "fw_000000.bin", stream[:cut])
    write_bin(tmp_path / "fw_000001.bin", stream[cut:])
    out = tmp_path / "shards"
    assert run("--format", "llm-c-bin", str(tmp_path / "fw_*.bin"), "--tokenizer",
               corpus["tokenizer"], "--out", str(out), *LAYOUT) == 0
    assert f"imported 2 files into {out}: 150 documents" in capsys.readouterr().out
    index = same_shards(out, from_text)
    assert index["sources"] == [str(tmp_path / "fw_000000.bin"), str(tmp_path / "fw_000001.bin")]
    held = [is_heldout(t, HELDOUT) for t in corpus["texts"]]
    assert 0 < sum(held) < len(held)
    for split, want_held in (("train", False), ("heldout", True)):
        ts = TokenStream(str(out), split=split, seq_len=8, batch_size=1, shuffle=False,
                         tokenizer_sha256=tok.sha256)
        got = [d.tolist() for d in ts.documents()]
        assert got == [d for d, h in zip(corpus["docs"], held) if h == want_held]
    assert sorted(tmp_path.iterdir()) == [tmp_path / "fw_000000.bin",
                                          tmp_path / "fw_000001.bin", out]  # no temporary left


@pytest.mark.parametrize("fmt,suffix", [("npy", ".npy"), ("raw-uint16", ".u16"),
                                        ("raw-uint32", ".u32"), ("llm-c-bin", ".bin")])
def test_npy_raw_and_uint32_bin_ids_import_as_the_bin_does(fmt, suffix, corpus, from_text,
                                                          tmp_path):
    """eos after each document (nanoGPT's layout), or before and after (empty runs between two
    eos are no documents): the same documents, the same shards. .bin: llm.c's Llama 3 layout
    (magic 20240801, version 7, uint32 ids)."""
    eos = corpus["tok"].eos_id
    ids = np.concatenate([[*d, eos] for d in corpus["docs"]])
    path = tmp_path / f"ids{suffix}"
    if fmt == "npy":
        np.save(path, ids.astype(np.int64))
    elif fmt == "llm-c-bin":
        ids = np.concatenate([[eos, *d, eos] for d in corpus["docs"]]).astype("<u4")
        header = np.zeros(256, dtype="<i4")
        header[:3] = 20240801, 7, len(ids)
        path.write_bytes(header.tobytes() + ids.tobytes())
    else:
        path.write_bytes(ids.astype("<u2" if fmt == "raw-uint16" else "<u4").tobytes())
    out = tmp_path / "shards"
    assert run("--format", fmt, str(path), "--tokenizer", corpus["tokenizer"], "--out", str(out),
               *LAYOUT) == 0
    same_shards(out, from_text)


def _bad_files(stream: np.ndarray, eos: int) -> dict:
    """name -> (format, file bytes, the offset the error line names)."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, len(stream)

    def bin_bytes(ids: np.ndarray, **fields: int) -> bytes:
        h = header.copy()
        for i, key in enumerate(("magic", "version", "count")):
            h[i] = fields.get(key, h[i])
        return h.tobytes() + ids.astype(np.uint16).tobytes()

    past = stream.copy()
    past[1000] = TINY_VOCAB + 7
    no_eos = stream[stream != eos]
    return {
        "wrong magic": ("llm-c-bin", bin_bytes(stream, magic=20240521), "byte 0:"),
        "unknown version": ("llm-c-bin", bin_bytes(stream, version=2), "byte 4:"),
        "count past the end": ("llm-c-bin", bin_bytes(stream, count=len(stream) + 1), "byte 8:"),
        "count short of the end": ("llm-c-bin", bin_bytes(stream, count=len(stream) - 3),
                                   "byte 8:"),
        "header cut short": ("llm-c-bin", header.tobytes()[:1000], "byte 1000:"),
        "id past the vocabulary": ("llm-c-bin", bin_bytes(past), "token 1,000 (byte 3,024):"),
        "no eos": ("llm-c-bin", bin_bytes(no_eos, count=len(no_eos)), "byte 1,024:"),
        "raw odd bytes": ("raw-uint16", stream.astype("<u2").tobytes() + b"\x01",
                          f"byte {2 * len(stream):,}:"),
        "raw id past the vocabulary": ("raw-uint32", past.astype("<u4").tobytes(),
                                       "token 1,000 (byte 4,000):"),
        "npy 2-D": ("npy", None, "byte 0:"),
        "npy negative id": ("npy", None, "token 5 (byte 148):"),
    }


@pytest.mark.parametrize("case", list(_bad_files(np.arange(2000, dtype=np.uint16), 2)))
def test_bad_token_file_is_one_line_exit_65_and_nothing_written(case, corpus, tmp_path, capsys):
    """A lying header, an id outside the vocabulary, no eos: exit 65, one line naming the file and
    the offset; an existing import at --out stays byte for byte, and no folder appears."""
    stream = corpus["stream"]
    fmt, data, where = _bad_files(stream, corpus["tok"].eos_id)[case]
    bad = tmp_path / "bad.tokens"
    if case == "npy 2-D":
        np.save(tmp_path / "bad.npy", stream.reshape(2, -1) if len(stream) % 2 == 0 else
                stream[1:].reshape(2, -1))
        bad = tmp_path / "bad.npy"
    elif case == "npy negative id":
        ids = stream.astype(np.int32)
        ids[5] = -1
        np.save(tmp_path / "bad.npy", ids)  # a 128-byte npy header, 4-byte ids
        bad = tmp_path / "bad.npy"
    else:
        bad.write_bytes(data)
    good = tmp_path / "good.bin"
    write_bin(good, stream)
    out = tmp_path / "shards"
    assert run("--format", "llm-c-bin", str(good), "--tokenizer", corpus["tokenizer"], "--out",
               str(out)) == 0
    capsys.readouterr()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    listing = sorted(tmp_path.iterdir())
    for target in (out, tmp_path / "new"):
        inputs = [str(bad)] if fmt != "llm-c-bin" else [str(good), str(bad)]
        assert run("--format", fmt, *inputs, "--tokenizer", corpus["tokenizer"], "--out",
                   str(target)) == 65
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert f"{bad}: {where}" in err, err
        assert sorted(tmp_path.iterdir()) == listing  # no new folder, no temporary
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before


def test_missing_file_and_foreign_folder(corpus, tmp_path, capsys):
    assert run("--format", "npy", str(tmp_path / "none-*.npy"), "--tokenizer",
               corpus["tokenizer"], "--out", str(tmp_path / "s")) == 66
    assert "none-*.npy" in capsys.readouterr().err
    good = tmp_path / "good.bin"
    write_bin(good, corpus["stream"])
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "index.json").write_text("{}")
    assert run("--format", "llm-c-bin", str(good), "--tokenizer", corpus["tokenizer"], "--out",
               str(foreign)) == 66
    assert "mine" in capsys.readouterr().err and (foreign / "index.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.bin", "mine"]


@pytest.mark.slow
def test_training_on_imported_shards_passes_the_tokenizer_check(corpus, tiny_config, tmp_path,
                                                                 subprocess_env):
    path = tmp_path / "fw.bin"
    write_bin(path, corpus["stream"])
    out = tmp_path / "shards"
    assert run("--format", "llm-c-bin", str(path), "--tokenizer", corpus["tokenizer"], "--out",
               str(out), *LAYOUT) == 0
    run_trainer(tiny_config(tmp_path, f"data.path={out}", "train.max_steps=3",
                            "train.checkpoint.every=3"), subprocess_env)
    steps = [m for m in read_metrics(tmp_path / "runs" / "tiny") if "loss" in m]
    assert steps[-1]["step"] == 3 and np.isfinite(steps[-1]["loss"]), steps


@pytest.mark.slow
def test_the_docs_commands_run_as_written(tmp_path, user_env):
    """docs/data.md's import and inspect, as written, on two llm.c files of GPT-2's layout (the
    eos before each document, a document cut across the files) with a small byte-level BPE at
    GPT-2's tokenizer path."""
    from scse_dist.data.tokenizer_hf import train_byte_bpe

    section = (REPO_ROOT / "docs/data.md").read_text().split("## Pre-tokenized corpora")[1]
    commands = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).splitlines()
    assert [c.split()[1] for c in commands] == ["import", "inspect"]
    texts = tiny_documents(300, seed=9)
    (tmp_path / "data/gpt2").mkdir(parents=True)
    train_byte_bpe(texts, TINY_VOCAB, str(tmp_path / "data/gpt2/tokenizer.json"))
    tok = Tokenizer.load(str(tmp_path / "data/gpt2/tokenizer.json"))
    stream = np.concatenate([[tok.eos_id, *d] for d in tok.encode_batch(texts)])
    (tmp_path / "fineweb10B").mkdir()
    write_bin(tmp_path / "fineweb10B/fineweb_val_000000.bin", stream[:len(stream) // 3])
    write_bin(tmp_path / "fineweb10B/fineweb_train_000001.bin", stream[len(stream) // 3:])
    for command in commands:
        out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=user_env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    # 300: the document cut at the end of the val file goes on in the first train file
    assert out.stdout.rstrip().splitlines()[-1].startswith("OK: read 300 documents"), out.stdout
