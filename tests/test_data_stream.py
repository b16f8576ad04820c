"""Shard writer + index, and TokenStream packing, rank split, shuffling and exact resume.

A fake tokenizer maps the text "10 11 12" to the ids [10, 11, 12], so expected windows can be
written by hand.
"""

import hashlib
import json
import os
from itertools import islice

import numpy as np
import pytest
import torch

from scse_dist.data.index import iter_samples, read_index
from scse_dist.data.sample_format import load_sample_table
from scse_dist.data.shards import TABLE_COLUMNS, is_heldout, write_shards
from scse_dist.data.stream import TokenStream

EOS = 2


class IntTokenizer:
    """Text of space-separated integers -> those ids (what write_shards needs of a Tokenizer)."""

    def __init__(self, vocab_size: int = 1000, sha256: str = "a" * 64):
        self.vocab_size, self.eos_id, self.sha256 = vocab_size, EOS, sha256

    def encode_batch(self, texts):
        return [[int(x) for x in t.split()] for t in texts]


def docs_of(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(str(3 + (i * 7 + k) % 900) for k in range(rng.integers(1, 40)))
            + f" {900 + i % 90}"
            for i in range(n)]


def write(tmp_path, docs, name="s", **kw):
    out = str(tmp_path / name)
    return out, write_shards(docs, IntTokenizer(**kw.pop("tok", {})), out, **kw)


def ids(text: str) -> list[int]:
    return [int(x) for x in text.split()]


# --------------------------------------------------------------------------- shards


def test_index_counts_match_what_was_written(tmp_path):
    docs = docs_of(200)
    out, index = write(tmp_path, docs, sample_tokens=100, shard_bytes=3000)
    assert index == read_index(out)
    assert (index["format"], index["dtype"], index["eos_id"], index["tokenizer_sha256"]) == (
        "scse-tokens-v2", "uint16", EOS, "a" * 64)
    train = index["splits"]["train"]
    assert len(train) > 2 and index["splits"]["heldout"] == []
    assert sum(s["tokens"] for s in train) == sum(len(ids(d)) for d in docs)
    assert sum(s["documents"] for s in train) == len(docs)
    read_docs, packed = [], []
    for s in train:
        tokens = docs_n = samples = 0
        raw = open(os.path.join(out, s["url"]), "rb").read()
        table = load_sample_table(os.path.join(out, s["table"]), s["samples"])
        assert table.dtype == np.int64 and table.shape == (s["samples"], len(TABLE_COLUMNS))
        decoded = iter_samples(os.path.join(out, s["url"]), EOS, index["vocab_size"])
        for (_, toks, lens), row in zip(decoded, table.tolist(), strict=True):
            assert row[:2] == [int(lens.sum()), len(lens)]  # sizes for resume arithmetic
            offsets = row[2:]
            assert toks.dtype == np.uint16 and lens.dtype == np.uint32
            tokens, docs_n, samples = tokens + int(lens.sum()), docs_n + len(lens), samples + 1
            packed += toks.tolist()
            ends = np.cumsum(lens + 1)
            read_docs += [toks[e - n - 1:e - 1].tolist() for e, n in zip(ends, lens)]
            # the index's offsets point at each member's bytes: the array data ends them
            t, tn, d, dn = offsets
            assert raw[t + tn - toks.nbytes:t + tn] == toks.tobytes()
            assert raw[d + dn - lens.nbytes:d + dn] == lens.tobytes()
        assert (tokens, docs_n, samples) == (s["tokens"], s["documents"], s["samples"])
    assert read_docs == [ids(d) for d in docs]  # whole documents, in order, nothing else
    assert packed == [t for d in docs for t in ids(d) + [EOS]]  # the training stream as stored
    _, big = write(tmp_path, docs[:3], name="big", tok={"vocab_size": 70000})
    assert big["dtype"] == "uint32"


def test_heldout_split_disjoint_and_stable(tmp_path):
    docs = docs_of(400)
    out1, index1 = write(tmp_path, docs, name="a", heldout_fraction=0.25, sample_tokens=64)
    out2, index2 = write(tmp_path, docs, name="b", heldout_fraction=0.25, sample_tokens=64)
    assert index1 == index2
    for entry in index1["splits"]["train"] + index1["splits"]["heldout"]:
        a, b = (open(os.path.join(o, entry["url"]), "rb").read() for o in (out1, out2))
        assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest()  # byte-identical re-run

    def split_docs(split):
        s = TokenStream(out1, split, seq_len=4, batch_size=1, loop=False, shuffle=False)
        return [tuple(d.tolist()) for d in s.documents()]

    held, train = split_docs("heldout"), split_docs("train")
    expected_held = [tuple(ids(d)) for d in docs if is_heldout(d, 0.25)]
    assert held == expected_held and 60 < len(held) < 140  # about a quarter
    assert not set(held) & set(train) and len(held) + len(train) == len(docs)


def test_read_index_errors_and_crash_leaves_the_output_as_it_was(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none" / "index.json")):
        read_index(str(tmp_path / "none"))
    out, index = write(tmp_path, docs_of(5))
    broken = dict(index, vocab_size="many")
    (tmp_path / "s" / "index.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="field 'vocab_size'"):
        read_index(out)
    del index["splits"]["train"][0]["tokens"]
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"splits.train\[0\].tokens"):
        read_index(out)

    def exploding():  # the rewrite dies half-way: the folder stays as it was (the write rule)
        yield from docs_of(5)
        raise RuntimeError("crash")

    before = {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()}
    with pytest.raises(RuntimeError):
        write_shards(exploding(), IntTokenizer(), out)
    assert {p.name: p.read_bytes() for p in (tmp_path / "s").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary folder left


# --------------------------------------------------------------------------- stream


def test_exact_packed_windows(tmp_path):
    out, _ = write(tmp_path, ["10 11 12", "20 21", "30 31 32 33"])
    s = TokenStream(out, "train", seq_len=3, batch_size=1, loop=False, shuffle=False)
    got = [b.tolist() for b in s]
    assert got == [[[10, 11, 12, EOS]], [[20, 21, EOS, 30]], [[31, 32, 33, EOS]]]
    # a finite stream keeps its last full windows as a smaller batch; a partial window is dropped
    s = TokenStream(out, "train", seq_len=2, batch_size=2, loop=False, shuffle=False)
    batches = list(s)
    assert [b.shape for b in batches] == [(2, 3), (2, 3)]
    assert batches[0].dtype == torch.long
    assert batches[1].tolist() == [[EOS, 30, 31], [32, 33, EOS]]
    s = TokenStream(out, "train", seq_len=4, batch_size=1, loop=False, shuffle=False)
    assert [b.tolist()[0] for b in s] == [[10, 11, 12, EOS, 20], [21, EOS, 30, 31, 32]]
    # looping runs on across the epoch boundary without wasting a token
    s = TokenStream(out, "train", seq_len=4, batch_size=1, loop=True, shuffle=False)
    assert [b.tolist()[0] for b in islice(s, 3)][2] == [33, EOS, 10, 11, 12]


@pytest.mark.parametrize("shard_bytes, sample_tokens, level", [
    (2000, 50, "shard"), (10**9, 50, "sample"), (10**9, 10**6, "document")])
def test_two_ranks_disjoint_and_cover_the_epoch(tmp_path, shard_bytes, sample_tokens, level):
    docs = docs_of(60)
    out, _ = write(tmp_path, docs, shard_bytes=shard_bytes, sample_tokens=sample_tokens)
    ranks = [TokenStream(out, "train", seq_len=8, batch_size=2, rank=r, world_size=2, loop=False)
             for r in range(2)]
    assert ranks[0].level == level
    seen = [[tuple(d.tolist()) for d in s.documents(epoch=0)] for s in ranks]
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(tuple(ids(d)) for d in docs)
    for s, rank_docs in zip(ranks, seen):  # each rank's batches are the packing of its documents
        packed = [t for d in rank_docs for t in d + (EOS,)]
        flat = torch.cat([b.flatten() for b in s]).tolist()
        assert flat == packed[: len(flat)] and len(packed) - len(flat) < 9


@pytest.mark.parametrize("shard_bytes", [10**9, 1000])  # one shard of many samples; many shards
def test_epoch_shuffle_is_seeded(tmp_path, shard_bytes):
    out, _ = write(tmp_path, docs_of(80), sample_tokens=20, shard_bytes=shard_bytes)
    order = lambda seed, epoch: [tuple(d.tolist()) for d in
                                 TokenStream(out, seq_len=4, batch_size=1,
                                             seed=seed).documents(epoch)]
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    assert sorted(order(0, 0)) == sorted(order(0, 1)) == sorted(tuple(ids(d)) for d in docs_of(80))
    unshuffled = TokenStream(out, "train", seq_len=4, batch_size=1, shuffle=False)
    assert [tuple(d.tolist()) for d in unshuffled.documents(3)] == \
        [tuple(ids(d)) for d in docs_of(80)]


@pytest.mark.parametrize("k", [3, 40])  # resume inside epoch 0, and several epochs later
def test_resume_gives_the_exact_next_batches(tmp_path, k):
    out, _ = write(tmp_path, docs_of(50), sample_tokens=30, shard_bytes=1500)
    for rank in range(2):
        make = lambda: TokenStream(out, seq_len=7, batch_size=3, rank=rank, world_size=2, seed=5)
        full = [b.tolist() for b in islice(make(), k + 5)]
        first = make()
        consumed = list(islice(first, k))
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        assert state["consumed_batches"] == k and [b.tolist() for b in consumed] == full[:k]
        resumed = make()
        resumed.load_state_dict(state)
        assert [b.tolist() for b in islice(resumed, 5)] == full[k:]
    if k == 40:
        assert state["epoch"] >= 2  # the resume point really lies past epoch boundaries
    other = TokenStream(out, seq_len=8, batch_size=3, world_size=2)
    with pytest.raises(ValueError, match="seq_len was 7, now 8"):
        other.load_state_dict(state)


def test_tokenizer_hash_mismatch_and_too_many_ranks(tmp_path):
    out, _ = write(tmp_path, docs_of(3))
    with pytest.raises(ValueError) as err:
        TokenStream(out, tokenizer_sha256="b" * 64)
    assert "b" * 64 in str(err.value) and "a" * 64 in str(err.value) and out in str(err.value)
    assert TokenStream(out, tokenizer_sha256="a" * 64).index["tokenizer_sha256"] == "a" * 64
    with pytest.raises(ValueError, match=r"3 documents, fewer than the 4 readers \(world_size=4"):
        TokenStream(out, rank=0, world_size=4)
