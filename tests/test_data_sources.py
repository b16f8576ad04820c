"""Adding a data source is one `Source` record (docs/architecture.md, "A data source"): the toy
`toy://N` of tests/toy_source.py, registered from here, is read by `scse-data shards` byte for byte
as a file of the same documents is, and split by `--part` at its own units; named by a plugin's
entry point it reaches `--processes` children too. The built-ins are asked in a fixed order, which
decides each input's source; the columnar ones load pyarrow or datasets only when read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, console_script, run_profiling_imports
from scse_dist.data.cli import main
from scse_dist.data.source_registry import SOURCES, by_priority, source_of
from scse_dist.data.sources import iter_documents, list_units
from scse_dist.typed_yaml import ConfigError
from toy_source import TOY, document

LAYOUT = ["--heldout-fraction", "0.1", "--sample-tokens", "500", "--shard-mb", "0.002",
          "--progress-every", "0"]
TOY_DOCS = [document(i) for i in range(40)]


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(SOURCES, "toy", TOY)


def _tree(d: Path, sources: list[str] | None = None) -> dict[str, object]:
    """Every file's bytes; index.json parsed, its inputs set to `sources` (all else compared)."""
    tree: dict[str, object] = {str(p.relative_to(d)): p.read_bytes()
                               for p in sorted(d.rglob("*")) if p.is_file()}
    tree["index.json"] = {**json.loads(tree["index.json"]), "sources": sources}  # type: ignore
    return tree


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> dict[str, object]:
    """The shards of toy://40's documents written as a JSONL file."""
    root = tmp_path_factory.mktemp("toy")
    (root / "toy.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TOY_DOCS))
    assert main(["shards", "--input", str(root / "toy.jsonl"), "--tokenizer",
                 tiny_data["tokenizer"], "--out", str(root / "ref"), *LAYOUT]) == 0
    return _tree(root / "ref", ["toy://40"])


def test_scse_data_reads_a_registered_source_as_it_reads_a_file(toy, reference, tiny_data,
                                                                tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["shards", "--input", "toy://40", "--tokenizer", tiny_data["tokenizer"],
                 "--out", str(out), *LAYOUT]) == 0
    assert f"shards {out}: 40 documents" in capsys.readouterr().out
    assert len(reference) > 4 and _tree(out, ["toy://40"]) == reference
    # --part K/N takes runs of its units, and the parts in turn are the whole, in order
    assert [(u.kind, u.rows) for u in list_units(["toy://40"])] == \
        [("toy", range(a, a + 8)) for a in range(0, 40, 8)]
    parts = [list(iter_documents("toy://40", part=(k, 3))) for k in range(3)]
    assert all(parts) and sum(parts, []) == TOY_DOCS


def test_an_unregistered_source_is_an_input_that_cannot_be_listed(tiny_data, tmp_path, capsys):
    assert main(["shards", "--input", "toy://40", "--tokenizer", tiny_data["tokenizer"],
                 "--out", str(tmp_path / "out")]) == 66
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "input 'toy://40' cannot be listed" in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_built_ins_are_asked_in_a_fixed_order(tmp_path, monkeypatch):
    assert [s.name for s in by_priority()] == ["hub", "parquet", "jsonl", "saved", "text"]
    (tmp_path / "d.jsonl").mkdir()
    decided = {"hf:wikitext:wikitext-2-raw-v1:test": "hub", "a/b.PARQUET": "parquet",
               "s3://b/x.parquet": "parquet", "x.jsonl.zst": "jsonl", "x.ndjson": "jsonl",
               str(tmp_path / "d.jsonl"): "jsonl", str(tmp_path): "saved",
               "x.parquet.gz": "text", "x.txt": "text", "x": "text"}
    assert {url: source_of(url).name for url in decided} == decided
    with pytest.raises(ConfigError, match="a Hub dataset is hf:NAME:SPLIT"):
        source_of("hf:wikitext")
    monkeypatch.setitem(SOURCES, "toy", TOY)  # priority 0: before every built-in
    assert by_priority()[0] is TOY and source_of("toy://3") is TOY
    assert source_of("x.txt").name == "text"


def test_reading_text_or_asking_for_help_loads_no_columnar_library(tmp_path, subprocess_env):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    code = ("from scse_dist.data.sources import iter_documents; "
            f"print(list(iter_documents({str(tmp_path / 'a.txt')!r})))")
    runs = [run_profiling_imports(cmd, subprocess_env, cwd=REPO_ROOT, timeout=120)
            for cmd in ([sys.executable, "-c", code], console_script("scse-data") + ["--help"])]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    assert runs[0].stdout == "['one', 'two']\n" and runs[1].stdout.startswith("usage:")
    assert [{"pyarrow", "datasets"} & r.imported for r in runs] == [set(), set()]


@pytest.mark.slow
def test_a_plugins_entry_point_reaches_the_processes(reference, tiny_data, tmp_path,
                                                    subprocess_env):
    site = tmp_path / "site"
    info = site / "toy_source_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-source-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[scse_dist.data_sources]\ntoy = toy_source:TOY\n")
    env = dict(subprocess_env, PYTHONPATH=f"{site}:{REPO_ROOT / 'tests'}:{REPO_ROOT}")
    out = tmp_path / "out"
    done = subprocess.run([*console_script("scse-data"), "shards", "--input", "toy://40",
                           "--tokenizer", tiny_data["tokenizer"], "--out", str(out), *LAYOUT,
                           "--processes", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"shards {out} (2 processes): 40 documents" in done.stdout
    assert _tree(out, ["toy://40"]) == reference
