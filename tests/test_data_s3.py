"""Real remote storage: an S3-compatible server (moto's standalone server) on loopback, driven
through s3fs. Shards are written to s3:// and the training stream reads them back over HTTP,
through DataLoader worker processes, with exact resume."""

from itertools import islice

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import fsspec  # noqa: E402

from scse_dist.data.index import read_index  # noqa: E402
from scse_dist.data.sample_format import load_sample_table  # noqa: E402
from scse_dist.data.shards import write_shards  # noqa: E402
from scse_dist.data.stream import TokenStream  # noqa: E402
from test_data_stream import IntTokenizer, docs_of  # noqa: E402

# A moto S3 server per test (30-100 s each on 2 busy cores): the slow tier.
pytestmark = pytest.mark.slow


def test_shards_written_to_and_streamed_from_s3(s3_bucket, tmp_path):
    docs = docs_of(120)
    url = f"{s3_bucket}/web/shards"
    index = write_shards(docs, IntTokenizer(), url, heldout_fraction=0.1, sample_tokens=60,
                         shard_bytes=2500)
    assert read_index(url) == index and len(index["splits"]["train"]) >= 4
    local = str(tmp_path / "local")  # the same corpus on local disk: the reference
    write_shards(docs, IntTokenizer(), local, heldout_fraction=0.1, sample_tokens=60,
                 shard_bytes=2500)
    make = lambda path, workers: TokenStream(path, seq_len=9, batch_size=2, rank=1, world_size=2,
                                             seed=3, num_workers=workers)
    want = [b.tolist() for b in islice(make(local, 2), 30)]
    remote = make(url, 2)
    assert [b.tolist() for b in islice(remote, 20)] == want[:20]
    state = remote.state_dict()
    resumed = make(url, 2)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in islice(resumed, 10)] == want[20:]
    # a brace pattern over s3 URLs, and held-out read sequentially in the training process
    first_two = TokenStream(f"{url}/train-{{000000..000001}}.tar", seq_len=9, batch_size=2,
                            shuffle=False, loop=False)
    assert len(first_two.urls) == 2 and list(first_two)
    held = [b.tolist() for b in TokenStream(url, "heldout", seq_len=9, batch_size=2, loop=False)]
    assert held == [b.tolist() for b in TokenStream(local, "heldout", seq_len=9, batch_size=2,
                                                    loop=False)]
    # a shard deleted from the bucket: a clear error at start-up
    fsspec.filesystem("s3").rm(f"{url}/{index['splits']['train'][2]['url']}")
    with pytest.raises(FileNotFoundError, match="train-000002.tar"):
        TokenStream(url)


def test_shuffled_epoch_downloads_each_sample_once(s3_bucket, s3_traffic, monkeypatch):
    """Random access reads exactly a sample per request: a shuffled epoch costs about the shards'
    bytes, not a read-ahead block per sample (s3fs reads ahead 50 MiB by default; 4 KiB here,
    so shards of a few hundred KiB show what 256 MiB shards would do), several GETs at a time."""
    url = f"{s3_bucket}/small-samples"
    index = write_shards(docs_of(1500), IntTokenizer(), url, sample_tokens=40, shard_bytes=200_000)
    entries = index["splits"]["train"]
    fs = fsspec.filesystem("s3")
    shard_bytes = sum(fs.size(f"{url}/{e['url']}") for e in entries)
    samples = sum(e["samples"] for e in entries)
    largest = max(int((t[:, 4] + t[:, 5] - t[:, 2]).max()) for t in (  # a sample's byte span
        load_sample_table(f"{url}/{e['table']}", e["samples"]) for e in entries))
    assert samples > 500 and len(entries) >= 2
    monkeypatch.setitem(fsspec.config.conf["s3"], "default_block_size", 4096)
    stream = TokenStream(url, seq_len=64, batch_size=4, shuffle=True, loop=False)
    before = len(s3_traffic.gets)
    s3_traffic.delay, s3_traffic.max_in_flight = 0.002, 0  # a round trip, so GETs can overlap
    tokens = sum(b.numel() for b in stream)
    assert s3_traffic.max_in_flight > 1  # the next samples are fetched concurrently
    assert tokens > 0.99 * sum(e["tokens"] + e["documents"] for e in entries)
    tar_gets = [n for path, n in s3_traffic.gets[before:] if path.endswith(".tar")]
    # one GET per sample, none larger than a sample (no read-ahead, no stream of a whole shard)
    assert len(tar_gets) == samples and max(tar_gets) <= largest
    assert sum(tar_gets) <= shard_bytes
