"""The streaming layer at scale: readers = ranks x DataLoader workers, coverage, exact resume with
workers, brace patterns, bad input (corrupt / truncated shards, missing shards) and mixtures."""

import json
import os
from collections import Counter
from itertools import islice

import fsspec
import numpy as np
import pytest

from scse_dist.cli_errors import InputError
from scse_dist.data.mixture import MixedStream
from scse_dist.data.stream import TokenStream
from test_data_stream import EOS, docs_of, write

# unique_docs' ids run past IntTokenizer's default vocabulary, which the reader checks them against
WIDE = {"vocab_size": 2**16 - 1}


def unique_docs(n: int, seed: int = 0) -> list[str]:
    """Documents whose token ids are all distinct and whose length is odd (so doc + eos is even);
    write them with tok=WIDE."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], 10
    for _ in range(n):
        length = 2 * int(rng.integers(0, 15)) + 1
        docs.append(" ".join(str(t) for t in range(next_id, next_id + length)))
        next_id += length
    return docs


def all_tokens(docs):
    return Counter([int(t) for d in docs for t in d.split()] + [EOS] * len(docs))


@pytest.mark.parametrize("world, workers, shard_bytes, sample_tokens, level", [
    (2, 2, 1500, 40, "shard"),        # 2 ranks x 2 workers over many shards
    (3, 0, 10**9, 40, "sample"),      # 3 ranks over fewer shards: split within shards
    (3, 2, 10**9, 10**6, "document")])  # 6 readers over 2 single-sample shards
def test_readers_are_disjoint_and_complete(tmp_path, world, workers, shard_bytes, sample_tokens,
                                           level):
    docs = unique_docs(90)
    if level == "document":  # exactly two shards of one sample each
        out = str(tmp_path / "s")
        write(tmp_path, docs[:45], name="a", sample_tokens=sample_tokens, tok=WIDE)
        write(tmp_path, docs[45:], name="b", sample_tokens=sample_tokens, tok=WIDE)
        index = json.loads((tmp_path / "a" / "index.json").read_text())
        other = json.loads((tmp_path / "b" / "index.json").read_text())["splits"]["train"][0]
        first = index["splits"]["train"][0]
        index["splits"]["train"] = [  # absolute urls: the shards stay where they were written
            dict(e, url=str(tmp_path / d / e["url"]), table=str(tmp_path / d / e["table"]))
            for d, e in (("a", first), ("b", other))]
        os.makedirs(out)
        (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    else:
        out, index = write(tmp_path, docs, shard_bytes=shard_bytes, sample_tokens=sample_tokens,
                           tok=WIDE)
    n_shards = len(json.loads(open(os.path.join(out, "index.json")).read())["splits"]["train"])
    assert (n_shards >= 4) if level == "shard" else (n_shards <= 2)
    streams = [TokenStream(out, seq_len=1, batch_size=3, rank=r, world_size=world, seed=3,
                           loop=False, num_workers=workers) for r in range(world)]
    assert streams[0].level == level and streams[0].n_readers == world * max(1, workers)
    # every reader's documents: a partition of the split
    per_reader = [[tuple(d.tolist()) for d in s.documents(epoch=1, worker=w)]
                  for s in streams for w in range(max(1, workers))]
    assert all(per_reader)  # no idle reader
    flat_docs = [d for r in per_reader for d in r]
    assert len(flat_docs) == len(set(flat_docs)) == len(docs)
    # the batches, through real DataLoader worker processes, hold every token exactly once
    seen = Counter()
    for s in streams:
        for batch in s:
            assert batch.shape[1] == 2
            seen.update(batch.flatten().tolist())
    assert seen == all_tokens(docs)


@pytest.mark.parametrize("k, workers, buffer, per_slot", [
    (5, 2, 0, [5, 0]), (101, 2, 4, [64, 37]), (7, 0, 4, [7])])  # workers send groups of 64 batches
def test_resume_with_workers_gives_the_exact_next_batches(tmp_path, k, workers, buffer, per_slot):
    out, _ = write(tmp_path, docs_of(60), sample_tokens=25, shard_bytes=900)
    make = lambda: TokenStream(out, seq_len=7, batch_size=2, rank=1, world_size=2, seed=4,
                               num_workers=workers, shuffle_buffer=buffer)
    full = [b.tolist() for b in islice(make(), k + 6)]
    first = make()
    assert [b.tolist() for b in islice(first, k)] == full[:k]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_batches"] == k
    assert [r["batches"] for r in state["readers"]] == per_slot
    if k == 101:
        assert min(r["epoch"] for r in state["readers"]) >= 1  # resume point lies past an epoch
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in islice(resumed, 6)] == full[k:]


def test_shuffle_buffer_reorders_but_keeps_the_epoch(tmp_path):
    out, _ = write(tmp_path, docs_of(80), sample_tokens=20, shard_bytes=600)
    docs = lambda buffer: [tuple(d.tolist()) for d in
                           TokenStream(out, seq_len=4, batch_size=1,
                                       shuffle_buffer=buffer).documents(0)]
    assert docs(8) != docs(0) and sorted(docs(8)) == sorted(docs(0)) and docs(8) == docs(8)


def test_one_ranks_state_alone_cannot_resume_another_layout(tmp_path):
    """load_state_dict takes one rank's state; a layout change needs every rank's (resume)."""
    out, _ = write(tmp_path, docs_of(40), sample_tokens=30)
    state = TokenStream(out, seq_len=4, batch_size=2, world_size=2, num_workers=2).state_dict()
    for world, workers in [(4, 2), (2, 1)]:
        other = TokenStream(out, seq_len=4, batch_size=2, world_size=world, num_workers=workers)
        with pytest.raises(ValueError) as err:
            other.load_state_dict(state)
        assert "world_size=2 x data.num_workers=2" in str(err.value)
        assert f"now world_size={world} x data.num_workers={workers}" in str(err.value)
        assert "needs every rank's state: TokenStream.resume(states)" in str(err.value)


def test_brace_pattern_selects_shards(tmp_path):
    out, index = write(tmp_path, docs_of(60), sample_tokens=20, shard_bytes=500,
                       heldout_fraction=0.1)
    names = [e["url"] for e in index["splits"]["train"]]
    assert len(names) >= 3
    s = TokenStream(f"{out}/train-{{000000..000001}}.tar", seq_len=4, batch_size=1, shuffle=False)
    assert [os.path.basename(u) for u in s.urls] == names[:2]
    assert s.index["tokenizer_sha256"] == "a" * 64
    with pytest.raises(FileNotFoundError,
                       match="2 shard.*not listed in .*index.json, e.g. .*train-000998.tar"):
        TokenStream(f"{out}/train-{{000998..000999}}.tar")
    # the trainer's start-up check finds the pattern's index (it looked for PATTERN/index.json)
    from scse_dist.data.config import DataConfig
    from scse_dist.data.quickstart import needs_build

    assert needs_build(DataConfig(path=f"{out}/train-{{000000..000001}}.tar")) is False
    # the held-out split beside a training pattern is read whole, as from the directory
    held = [b.tolist() for b in TokenStream(f"{out}/train-{{000000..000001}}.tar", "heldout",
                                            seq_len=4, batch_size=1, loop=False)]
    assert held and held == [b.tolist() for b in TokenStream(out, "heldout", seq_len=4,
                                                             batch_size=1, loop=False)]


def test_missing_shard_and_unreachable_storage_fail_at_start_up(tmp_path):
    out, index = write(tmp_path, docs_of(60), sample_tokens=20, shard_bytes=500)
    os.remove(os.path.join(out, index["splits"]["train"][1]["url"]))
    with pytest.raises(FileNotFoundError, match="1 shard.*missing.*train-000001.tar"):
        TokenStream(out)
    os.remove(os.path.join(out, index["splits"]["train"][2]["table"]))
    with pytest.raises(FileNotFoundError, match="2 shard.*missing.*train-000001.tar"):
        TokenStream(out)
    index["splits"]["train"].pop(1)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(FileNotFoundError, match="1 shard.*missing.*train-000002.samples.npy"):
        TokenStream(out)
    with pytest.raises(OSError, match="cannot read shard index 'nosuchproto://x/index.json'"):
        TokenStream("nosuchproto://x")


def corrupt(path: str, how: str) -> None:
    data = bytearray(open(path, "rb").read())
    if how == "truncate":  # cut inside the last array (the tail is mostly tar padding)
        data = data[: data.rindex(b"\x93NUMPY") + 10]
    elif how == "eos":  # a well-formed array whose first document lost its eos separator
        magic = data.index(b"\x93NUMPY")
        start = magic + 10 + int.from_bytes(data[magic + 8:magic + 10], "little")
        tokens = np.frombuffer(bytes(data[start:start + 2000]), np.uint16)
        first_eos = start + 2 * int(np.flatnonzero(tokens == EOS)[0])
        data[first_eos:first_eos + 2] = (7).to_bytes(2, "little")
    elif how == "vocab":  # flipped bits: the first token of the first sample is 65535
        magic = data.index(b"\x93NUMPY")
        start = magic + 10 + int.from_bytes(data[magic + 8:magic + 10], "little")
        data[start:start + 2] = b"\xff\xff"
    else:  # overwrite the first tokens.npy payload's magic: np.load fails on it
        at = data.index(b"\x93NUMPY")
        data[at:at + 6] = b"garbag"
    open(path, "wb").write(bytes(data))


# local shards are mmapped; remote ones (memory://) are streamed in file order, ranged reads
# shuffled
@pytest.mark.parametrize("storage", ["local", "memory"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_corrupt_shards_are_skipped_counted_and_resume_stays_exact(tmp_path, shuffle, storage,
                                                                   capfd):
    docs = docs_of(80)
    out, index = write(tmp_path, docs, sample_tokens=20, shard_bytes=700)
    entries = index["splits"]["train"]
    corrupt(os.path.join(out, entries[0]["url"]), "truncate")
    corrupt(os.path.join(out, entries[1]["url"]), "eos")
    corrupt(os.path.join(out, entries[2]["url"]), "garble")
    with open(os.path.join(out, entries[3]["table"]), "wb") as f:  # a sample table cut short
        f.write(b"\x93NUMPY\x01\x00")
    if storage == "memory":
        out = f"memory://{tmp_path.name}-{shuffle}"
        fsspec.filesystem("memory").put(os.path.join(str(tmp_path), "s"), out, recursive=True)
    make = lambda: TokenStream(out, seq_len=5, batch_size=2, shuffle=shuffle, loop=False, seed=1)
    stream = make()
    got = [tuple(d.tolist()) for d in stream.documents(0)]
    full = [b.tolist() for b in make()]
    assert [b.tolist() for b in islice(stream, 30)] == full[:30]
    state = json.loads(json.dumps(stream.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    # resume after skipped corrupt data: the same batches as without a restart
    assert [b.tolist() for b in resumed] == full[30:]
    assert resumed.failures == 4 and len(resumed.state_dict()["bad"]) >= 3 + entries[3]["samples"]
    # one line per bad shard or sample, naming it; no Python warning with its source line
    messages = capfd.readouterr().err.splitlines()
    assert messages and all(m.startswith("skipping ") for m in messages), messages
    assert any(entries[0]["url"] in m for m in messages)
    assert any(entries[1]["url"] in m and "does not end in eos 2" in m for m in messages)
    assert any(entries[2]["url"] in m and "undecodable" in m for m in messages)
    assert any(entries[3]["table"] in m and "unreadable sample table" in m for m in messages)
    good = {tuple(int(t) for t in d.split()) for d in docs}
    assert set(got) < good and len(got) < len(docs)  # only whole, correct documents remain
    assert len(got) >= len(docs) - sum(e["documents"] for e in entries[:4])


@pytest.mark.parametrize("shuffle", [False, True])  # read in file order / sample by sample
def test_a_token_id_past_the_vocabulary_is_a_bad_sample_named_by_shard_and_sample(
        tmp_path, capfd, shuffle):
    out, index = write(tmp_path, docs_of(60), sample_tokens=20, shard_bytes=500)
    url = os.path.join(out, index["splits"]["train"][0]["url"])
    corrupt(url, "vocab")
    batches = list(TokenStream(out, seq_len=5, batch_size=2, shuffle=shuffle, loop=False))
    assert max(int(b.max()) for b in batches) < 1000  # never past the embedding
    assert capfd.readouterr().err == (f"skipping 1 bad sample(s): {url}: sample 0: token id "
                                      "65535 past the vocabulary (vocab_size 1000)\n")
    # past data.max_failures it stops: the one line names the shard and the sample, also when a
    # DataLoader worker met it (torch re-raises it with the worker's traceback as its message)
    for workers in (0, 1):
        with pytest.raises(InputError) as err:
            list(TokenStream(out, seq_len=5, batch_size=2, shuffle=shuffle, max_failures=0,
                             num_workers=workers))
        assert str(err.value).startswith(f"{url}: sample 0: token id 65535 past the vocabulary "
                                         "(vocab_size 1000) (1 bad shards/samples, more than "
                                         "data.max_failures=0)"), str(err.value)
        assert "Traceback" not in str(err.value)
        assert capfd.readouterr().err == ""


def test_too_many_failures_stop_the_run(tmp_path):
    out, index = write(tmp_path, docs_of(60), sample_tokens=20, shard_bytes=500)
    for e in index["splits"]["train"][:3]:
        corrupt(os.path.join(out, e["url"]), "truncate")
    stream = TokenStream(out, seq_len=5, batch_size=2, max_failures=1, shuffle=False)
    with pytest.raises(InputError, match="2 bad shards/samples, more than data.max_failures=1"):
        list(islice(stream, 100))
    for e in index["splits"]["train"]:  # nothing readable at all: an error, not an endless loop
        corrupt(os.path.join(out, e["url"]), "truncate")
    stream = TokenStream(out, seq_len=5, batch_size=2, max_failures=1000, shuffle=False)
    with pytest.raises(InputError, match="no readable data"):  # a data error (65), not a crash
        next(iter(stream))


def test_mixture_weights_hold_and_resume(tmp_path):
    corpora = []
    for c, base in enumerate((100, 300, 500)):  # each corpus has its own token range
        docs = [" ".join(str(base + (i + k) % 150) for k in range(12)) for i in range(40)]
        out, _ = write(tmp_path, docs, name=f"c{c}", sample_tokens=50)
        corpora.append(out)
    make = lambda: MixedStream([TokenStream(p, seq_len=8, batch_size=1, seed=2) for p in corpora],
                               [0.6, 0.3, 0.1], seed=2)
    batches = list(islice(make(), 3000))
    source = Counter(next(c for c, base in enumerate((100, 300, 500))
                          if base <= int(b[0, b[0] != EOS].max()) < base + 150) for b in batches)
    shares = np.array([source[c] for c in range(3)]) / len(batches)
    assert np.allclose(shares, [0.6, 0.3, 0.1], atol=0.03), shares
    first = make()
    list(islice(first, 123))
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in islice(resumed, 20)] == [b.tolist() for b in batches[123:143]]
    with pytest.raises(ValueError, match="mixture_weights"):
        MixedStream(first.streams, [1.0, 0.0, 1.0])


def test_layout_changes_read_every_token_and_sample_of_the_epoch_once(tmp_path, monkeypatch):
    """2 ranks -> 3 ranks -> 1 rank with 2 workers, in one finite epoch: the tokens of all
    consumed batches are the corpus exactly (even-length documents, width-2 rows: no token is
    dropped by packing), and the readers' own sample logs name every sample once."""
    docs = unique_docs(90)
    out, _ = write(tmp_path, docs, sample_tokens=40, tok=WIDE)
    monkeypatch.setenv("SCSE_LOG_SAMPLES", str(tmp_path / "log"))
    make = lambda rank, world, workers=0: TokenStream(out, seq_len=1, batch_size=batch, rank=rank,
                                                      world_size=world, seed=7, loop=False,
                                                      num_workers=workers)
    tokens, states = Counter(), None
    # the micro-batch may change with the layout too (positions are token counts); `make` reads
    # `batch` from here
    for world, workers, batch, take in [(2, 0, 3, 5), (3, 0, 2, 4), (1, 2, 3, None)]:  # noqa: B007
        streams = [make(r, world, workers) for r in range(world)]
        for s in streams:
            if states:
                s.resume(json.loads(json.dumps(states)))  # as a JSON-safe checkpoint holds it
            for got in islice(s, take):
                tokens.update(got.flatten().tolist())
        if world == 3:  # a second resume at the same layout is bit-exact, the carry included
            again = make(1, 3)
            again.resume(json.loads(json.dumps([s.state_dict() for s in streams])))
            ahead = [b.tolist() for b in islice(streams[1], 3)]
            tokens.update(t for b in ahead for row in b for t in row)
            assert [b.tolist() for b in islice(again, 3)] == ahead
            streams[1] = again  # continue from the resumed one, at the same position
        states = [s.state_dict() for s in streams]
        assert all(st["origin"] is not None for st in states) == bool(world != 2)
    assert tokens == all_tokens(docs)
    logged = [json.loads(line) for f in (tmp_path / "log").iterdir()
              for line in f.read_text().splitlines()]
    assert {tuple(x["layout"]) for x in logged} == {(2, 0), (3, 0), (1, 2)}
    items = Counter(tuple(x["item"]) for x in logged if x["epoch"] == 0)
    units = {(0, j, -1) for j in range(make(0, 1).n_samples[0])}
    assert len(units) > 10 and set(items) == units and set(items.values()) == {1}


def test_a_changed_seed_or_shuffle_buffer_is_refused_saying_why_and_what_to_do(tmp_path):
    out, _ = write(tmp_path, docs_of(40), sample_tokens=30)
    states = [TokenStream(out, seq_len=4, batch_size=2, rank=r, world_size=2).state_dict()
              for r in range(2)]
    for kw, field in [(dict(seed=1), "train.seed was 0, now 1"),
                      (dict(shuffle_buffer=4), "data.shuffle_buffer was 0, now 4")]:
        with pytest.raises(ValueError) as err:
            TokenStream(out, seq_len=8, batch_size=2, world_size=1, **kw).resume(states)
        assert str(err.value) == (f"cannot resume data stream: {field}; the readers' seeded order, "
                                  "and so which samples were read, depends on it. Set it back, or "
                                  "start a new run (another name)")


def test_a_mixture_resumes_at_another_world_size_reading_each_corpus_once(tmp_path):
    """Two corpora, 2 ranks -> 1 rank: every token of each finite corpus is read once."""
    docs = [unique_docs(40, seed=1), [" ".join(str(int(t) + 5000) for t in d.split())
                                      for d in unique_docs(40, seed=2)]]
    paths = [write(tmp_path / f"c{i}", d, sample_tokens=40, tok=WIDE)[0]
             for i, d in enumerate(docs)]
    make = lambda rank, world: MixedStream(
        [TokenStream(p, seq_len=1, batch_size=2, rank=rank, world_size=world, seed=3, loop=False)
         for p in paths], [0.5, 0.5], seed=3)
    tokens = Counter()
    first = [make(r, 2) for r in range(2)]
    for s in first:
        tokens.update(t for b in islice(s, 20) for t in b.flatten().tolist())
    resumed = make(0, 1)
    resumed.resume(json.loads(json.dumps([s.state_dict() for s in first])))
    assert resumed.consumed == 20
    for stream in resumed.streams:  # each corpus to its end (the mixture stops at the first end)
        tokens.update(t for b in stream for t in b.flatten().tolist())
    assert tokens == all_tokens(docs[0]) + all_tokens(docs[1])
