"""Parquet files and directories, `datasets.save_to_disk` directories and bad rows, through
`scse-data tokenizer` and `scse-data shards`: the same documents give the same shards as JSONL,
in a fixed order whatever order the files are listed in. All local files: no network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import TINY_VOCAB, tiny_documents
from scse_dist.data.cli import main
from scse_dist.data.rows import RowStats
from scse_dist.data.sources import expand_inputs, iter_documents, list_units, partition

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = tiny_documents(300, seed=3)


def _parquet(path: Path, texts: list, row_group_size: int = 40, column: str = "text") -> None:
    table = pa.table({column: texts, "id": list(range(len(texts)))})
    pq.write_table(table, path, row_group_size=row_group_size)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """The same 300 documents as one JSONL file, as parquet files in a directory (names sorted
    in document order), and the tokenizer trained on the JSONL."""
    root = tmp_path_factory.mktemp("columnar")
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    pdir = root / "parquet"
    (pdir / "b").mkdir(parents=True)
    # written in another order than their names: the reading order is by path
    _parquet(pdir / "b" / "part-2.parquet", DOCS[200:])
    _parquet(pdir / "a-part-0.parquet", DOCS[:120])
    _parquet(pdir / "b" / "part-1.parquet", DOCS[120:200])
    model = str(root / "tok.model")
    assert main(["tokenizer", "--input", str(jsonl), "--vocab-size", str(TINY_VOCAB),
                 "--out", model]) == 0
    return {"root": str(root), "jsonl": str(jsonl), "parquet": str(pdir), "tok": model}


def test_parquet_documents_in_path_order_whatever_the_listing(corpus):
    pdir = corpus["parquet"]
    files = [f"{pdir}/b/part-2.parquet", f"{pdir}/a-part-0.parquet", f"{pdir}/b/part-1.parquet"]
    assert list(iter_documents(pdir)) == DOCS  # the directory: its files sorted by path
    assert list(iter_documents(f"{pdir}/**/*.parquet")) == DOCS[:120] + DOCS[120:]
    assert expand_inputs(pdir) == sorted(files)
    # files named one by one keep the order given (as for JSONL)
    assert list(iter_documents(files)) == DOCS[200:] + DOCS[:200]
    # units are row groups: 120 rows in groups of 40 -> 3, 80 -> 2, 100 -> 3
    units = list_units(expand_inputs(pdir))
    assert [(Path(u.url).name, u.rows.start) for u in units] == \
        [("a-part-0.parquet", 0), ("a-part-0.parquet", 1), ("a-part-0.parquet", 2),
         ("part-1.parquet", 0), ("part-1.parquet", 1),
         ("part-2.parquet", 0), ("part-2.parquet", 1), ("part-2.parquet", 2)]
    for n in (1, 2, 3, 5):
        parts = [partition(units, k, n) for k in range(n)]
        assert [u for p in parts for u in p] == units  # contiguous, in order, all of them
        assert [d for k in range(n) for d in iter_documents(pdir, part=(k, n))] == DOCS


def test_parquet_and_jsonl_of_the_same_documents_give_identical_shards(corpus, tmp_path, capsys):
    outs = {}
    for name, inp in [("jsonl", corpus["jsonl"]), ("parquet", corpus["parquet"])]:
        outs[name] = tmp_path / name
        assert main(["shards", "--input", inp, "--tokenizer", corpus["tok"], "--out",
                     str(outs[name]), "--heldout-fraction", "0.1", "--sample-tokens", "300",
                     "--shard-mb", "0.005", "--progress-every", "0"]) == 0
        assert "300 documents" in capsys.readouterr().out
    a, b = _tree(outs["jsonl"]), _tree(outs["parquet"])
    index_a, index_b = json.loads(a.pop("index.json")), json.loads(b.pop("index.json"))
    assert len(a) > 4 and a == b  # every shard and table, byte for byte
    assert index_a["sources"] == [corpus["jsonl"]] and index_b["sources"] == [corpus["parquet"]]
    index_a["sources"] = index_b["sources"]
    assert index_a == index_b


def test_saved_dataset_directory_is_read_in_order(corpus, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(
        str(saved))
    assert list(iter_documents(str(saved), text_field="body")) == DOCS
    units = list_units(expand_inputs(str(saved)))
    assert [(u.kind, u.rows) for u in units] == [("saved", range(0, 300))]
    out = tmp_path / "shards"
    assert main(["shards", "--input", str(saved), "--text-field", "body", "--tokenizer",
                 corpus["tok"], "--out", str(out), "--progress-every", "0"]) == 0
    assert "300 documents" in capsys.readouterr().out
    ref = tmp_path / "ref"
    assert main(["shards", "--input", corpus["jsonl"], "--tokenizer", corpus["tok"], "--out",
                 str(ref), "--progress-every", "0"]) == 0
    a, b = _tree(out), _tree(ref)
    assert a.pop("index.json") != b.pop("index.json") and a == b  # sources differ, shards not
    # a DatasetDict's directory: refused, naming its splits
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]}),
                          "test": datasets.Dataset.from_dict({"text": ["y"]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert main(["shards", "--input", str(tmp_path / "dd"), "--tokenizer", corpus["tok"],
                 "--out", str(tmp_path / "x")]) == 2
    assert f"is a datasets DatasetDict (splits ['test', 'train']); give one split's directory, " \
           f"e.g. {tmp_path / 'dd'}/test" in capsys.readouterr().err


def test_bad_rows_are_counted_and_over_the_limit_one_line(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    texts = [DOCS[0], None, "", "   ", DOCS[1], None, DOCS[2]]
    _parquet(bad, texts, row_group_size=3)
    stats = RowStats(max_bad_rows=2)
    assert list(iter_documents(str(bad), stats=stats)) == DOCS[:3]
    assert (stats.rows, stats.empty, stats.bad) == (7, 2, 2)
    assert stats.first_bad == [f"{bad}: row 1: field 'text' is null, expected a string",
                               f"{bad}: row 5: field 'text' is null, expected a string"]
    # the tokenizer and shards commands report the count on their last line
    out = tmp_path / "s"
    assert main(["shards", "--input", str(bad), "--tokenizer", corpus["tok"], "--out", str(out),
                 "--max-bad-rows", "2", "--progress-every", "0"]) == 0
    assert "3 documents" in (line := capsys.readouterr().out) and \
        f"skipped 2 empty and 2 bad rows of 7 (first: {bad}: row 1: field 'text' is null" in line
    # over the limit (default 0): one line naming the file, the row and the count
    assert main(["shards", "--input", str(bad), "--tokenizer", corpus["tok"], "--out",
                 str(out)]) == 65
    assert capsys.readouterr().err == (
        f"scse-data: error: {bad}: row 1: field 'text' is null, expected a string; 1 bad row so "
        "far, over --max-bad-rows 0 (raise it to skip them)\n")
    # a missing column: every row is bad; a JSONL without the field as before, with the count
    other = tmp_path / "other.parquet"
    _parquet(other, DOCS[:5], column="content")
    assert main(["tokenizer", "--input", str(other), "--vocab-size", "300", "--out",
                 str(tmp_path / "t.model"), "--max-bad-rows", "4"]) == 65
    assert capsys.readouterr().err == (
        f"scse-data: error: {other}: row 4: no field 'text' (set --text-field; columns: "
        "['content', 'id']); 5 bad rows so far, over --max-bad-rows 4 (raise it to skip them)\n")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a b c"}\n{"body": 1}\n{"text": 7}\n{"text": "d e"}\n')
    stats = RowStats(max_bad_rows=5)
    assert list(iter_documents(str(nofield), stats=stats)) == ["a b c", "d e"]
    assert stats.first_bad == [f"{nofield}:2: no field 'text' (set --text-field; keys: ['body'])",
                               f"{nofield}:3: field 'text' is int, expected a string"]
    # the tokenizer prints the counts too
    assert main(["tokenizer", "--input", str(bad), corpus["jsonl"], "--vocab-size", "300",
                 "--out", str(tmp_path / "t.model"), "--max-bad-rows", "9"]) == 0
    assert "skipped 2 empty and 2 bad rows of 307" in capsys.readouterr().out


def test_missing_packages_and_bad_specs_are_one_line(corpus, tmp_path, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    monkeypatch.setattr("importlib.import_module", lambda name: no_pyarrow(name))
    assert main(["shards", "--input", corpus["parquet"], "--tokenizer", corpus["tok"],
                 "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err == ("scse-data: config error: reading this input needs the "
                                       "'pyarrow' package: pip install 'scse-dist[parquet]'\n")
    monkeypatch.undo()
    assert main(["shards", "--input", "hf:onlyname", "--tokenizer", corpus["tok"],
                 "--out", str(tmp_path / "s")]) == 2
    assert "a Hub dataset is hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT" in capsys.readouterr().err
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    assert main(["shards", "--input", str(empty), "--tokenizer", corpus["tok"],
                 "--out", str(tmp_path / "s")]) == 66
    assert "holds no .parquet file nor a datasets save_to_disk dataset" in \
        capsys.readouterr().err
    assert not os.path.exists(tmp_path / "s" / "index.json")
