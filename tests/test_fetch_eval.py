"""scse-data fetch-eval, offline (a local mirror as --source): the files are checked against the
manifest's sha256, size and rows, prepared (a parquet's text column joined unchanged; a JSONL
copied), and written with their checksums; a mismatched or unrecorded checksum is one line,
exit 65, and nothing is written. The shipped manifest pins what the GPU study evaluates on."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO_ROOT

WIKI_ROWS = ["", " = Valkyria = \n", "", " The game began in 2010 . \n", " It sold well . \n"]
LAMBADA = '{"text": "he held the door for her"}\n{"text": "she thanked him"}\n'


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def mirror(tmp_path):
    """A fake Hub mirror with one WikiText parquet and one LAMBADA JSONL, and its manifest."""
    wiki = tmp_path / "hub" / "Salesforce/wikitext" / "w103/test.parquet"
    wiki.parent.mkdir(parents=True)
    pq.write_table(pa.table({"text": WIKI_ROWS}), wiki)
    lam = tmp_path / "hub" / "EleutherAI/lambada_openai" / "data/test.jsonl"
    lam.parent.mkdir(parents=True)
    lam.write_text(LAMBADA)
    files = [{"out": "wiki.test.raw", "repo": "Salesforce/wikitext", "revision": "a" * 40,
              "path": "w103/test.parquet", "bytes": wiki.stat().st_size, "rows": 5,
              "sha256": sha(wiki), "format": "parquet-lines"},
             {"out": "lambada_test.jsonl", "repo": "EleutherAI/lambada_openai",
              "revision": "b" * 40, "path": "data/test.jsonl", "bytes": lam.stat().st_size,
              "rows": 2, "sha256": sha(lam), "format": "copy"}]
    return tmp_path, files


def fetch(tmp_path, files, *extra):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": files}))
    return subprocess.run([sys.executable, "-m", "scse_dist.data.cli", "fetch-eval", "--manifest",
                           str(manifest), "--source", str(tmp_path / "hub"), "--out",
                           str(tmp_path / "out"), *extra], capture_output=True, text=True,
                          cwd=REPO_ROOT)


def test_fetch_eval_checks_and_prepares_every_file(mirror):
    tmp_path, files = mirror
    done = fetch(tmp_path, files)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert (out / "wiki.test.raw").read_text() == "".join(WIKI_ROWS)  # the raw file's bytes
    assert (out / "lambada_test.jsonl").read_text() == LAMBADA
    assert (out / "checksums.sha256").read_text().splitlines() == [
        f"{sha(out / 'wiki.test.raw')}  wiki.test.raw",
        f"{sha(out / 'lambada_test.jsonl')}  lambada_test.jsonl"]
    assert done.stdout.splitlines()[0].startswith("wiki.test.raw: 5 rows from Salesforce/wikitext")
    # the prepared files read as the tasks read them
    from scse_dist.eval.tasks.lambada import read_lambada

    assert len(read_lambada(str(out / "lambada_test.jsonl"))) == 2


@pytest.mark.parametrize("change, message", [
    ({"sha256": "0" * 64}, "EleutherAI/lambada_openai/data/test.jsonl@bbbbbbbbbbbb: sha256 "),
    ({"rows": 5153}, "EleutherAI/lambada_openai/data/test.jsonl@bbbbbbbbbbbb: 2 rows, the "
                     "manifest records 5153"),
    ({"sha256": None}, "EleutherAI/lambada_openai/data/test.jsonl@bbbbbbbbbbbb: no sha256 "
                       "recorded in the manifest; this file's is "),
])
def test_a_file_that_does_not_match_its_manifest_writes_nothing(mirror, change, message):
    tmp_path, files = mirror
    files[1].update(change)
    done = fetch(tmp_path, files)
    assert done.returncode == 65 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"scse-data: error: {message}"), done.stderr
    assert not (tmp_path / "out").exists()
    if change == {"sha256": None}:  # recorded by hand, or accepted and printed
        accepted = fetch(tmp_path, files, "--accept-unrecorded")
        assert accepted.returncode == 0, accepted.stderr
        assert f"(sha256 {sha(tmp_path / 'hub/EleutherAI/lambada_openai/data/test.jsonl')}, NOT "\
            "RECORDED, record it)" in accepted.stdout


def test_the_shipped_manifest_pins_the_gpu_studys_files():
    from scse_dist.data.eval_files import read_manifest
    from scse_dist.study.spec import load_spec

    files = {f["out"]: f for f in read_manifest(REPO_ROOT / "configs/eval/gpu.json")}
    assert files["lambada_test.jsonl"]["rows"] == 5153
    assert files["lambada_test.jsonl"]["sha256"] == \
        "4aa8d02cd17c719165fc8a7887fddd641f43fcafa4b1c806ca8abc31fabdb226"
    assert files["wiki.test.raw"]["path"] == "wikitext-103-raw-v1/test-00000-of-00001.parquet"
    spec = load_spec(REPO_ROOT / "configs/studies/gpt2-small-decisive.yaml")
    # the study reads what the command writes
    # (the spec's paths resolve against its directory: the checkout's data/eval-gpu)
    assert spec.evals.wikitext == str(REPO_ROOT / "data/eval-gpu/wiki.test.raw")
    assert spec.evals.lambada == str(REPO_ROOT / "data/eval-gpu/lambada_test.jsonl")
    assert spec.validation is not None and \
        spec.validation.path == str(REPO_ROOT / "data/eval-gpu/wiki.valid.raw")
