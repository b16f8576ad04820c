"""Tokenizer training/loading and document sources (text, JSONL, gzip, globs)."""

import gzip
import json
import random

import fsspec
import pytest

from scse_dist.data.sources import iter_documents
from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

WORDS = ("looped transformer state source anchor deviation recurrence depth token shard "
         "the a of and to in is for with on").split()


def corpus(n_docs: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15)))
                      for _ in range(rng.randint(1, 4))) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return train_tokenizer(corpus(), 320, str(tmp_path_factory.mktemp("tok") / "t.model"))


def test_round_trip_ids_and_determinism(model_path, tmp_path):
    tok = Tokenizer.load(model_path)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.sp.unk_id(), tok.sp.pad_id()) == \
        (320, 2, 1, 0, -1)
    # identity normaliser + byte fallback: whitespace runs, tabs, newlines, unseen scripts survive
    for text in ["looped transformer state", "  two  spaces\tand\ttabs\n\nnewlines ",
                 "Ünïcode 😀 and digits 1234567", corpus(1, seed=9)[0]]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert 0 not in ids  # never <unk>
    assert tok.encode_batch(["the token", "a shard"]) == \
        [tok.encode("the token"), tok.encode("a shard")]
    # a frequent word compresses: fewer tokens than characters
    assert len(tok.encode("transformer")) < len("transformer")
    # same texts and options -> byte-identical model; load works from any fsspec URL
    again = train_tokenizer(corpus(), 320, str(tmp_path / "again.model"))
    assert Tokenizer.load(again).sha256 == tok.sha256
    with open(model_path, "rb") as f:
        fsspec.filesystem("memory").pipe("/tok/t.model", f.read())
    remote = Tokenizer.load("memory://tok/t.model")
    assert remote.sha256 == tok.sha256 and remote.encode("the anchor") == tok.encode("the anchor")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size: 100 is too small"):
        train_tokenizer(corpus(10), 100, str(tmp_path / "x.model"))
    missing = str(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match="missing.model"):
        Tokenizer.load(missing)


def test_sources_gzip_jsonl_text_and_errors(tmp_path):
    rows = [{"body": "first doc", "id": 1}, {"body": "second\n\ndoc", "id": 2},
            {"body": "  ", "id": 3}]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "b.txt").write_text("para one\nline two\n\n\npara two\n")
    # blank-JSON-lines and whitespace-only documents are skipped; the text's blank lines split docs
    assert list(iter_documents([str(tmp_path / "*.jsonl.gz"), str(tmp_path / "b.txt")],
                               text_field="body")) == [
        "first doc", "second\n\ndoc", "para one\nline two", "para two"]
    assert list(iter_documents(str(tmp_path / "b.txt"), text_split="file")) == [
        "para one\nline two\n\n\npara two\n"]
    with pytest.raises(ValueError, match=r"a.jsonl.gz:1: no field 'text'"):
        list(iter_documents(str(tmp_path / "a.jsonl.gz")))
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        list(iter_documents(str(tmp_path / "nothing-here*.txt")))
