"""Shards and inputs over http:// (fsspec's HTTP filesystem, aiohttp) from a real HTTP server on
loopback that serves a directory with byte ranges, as object stores and CDNs do."""

import http.server
import os
import re
import shutil
import threading
from functools import partial
from itertools import islice

import pytest

pytest.importorskip("aiohttp")

from scse_dist.data.sources import iter_documents  # noqa: E402
from scse_dist.data.stream import TokenStream  # noqa: E402
from test_data_stream import docs_of, write  # noqa: E402

# An HTTP server with byte ranges on loopback: the slow tier.
pytestmark = pytest.mark.slow


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus `Range: bytes=a-b` (206 answers); counts the GETs."""

    gets: list = []

    def send_head(self):
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if match is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        left = getattr(self, "_left", None)
        outputfile.write(source.read() if left is None else source.read(left))

    def do_GET(self):
        RangeHandler.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             partial(RangeHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RangeHandler.gets = []
    yield root, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_shards_and_inputs_over_http(http_root, tmp_path):
    root, url = http_root
    docs = docs_of(150)
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    assert list(iter_documents(f"{url}/corpus.txt")) == docs  # an input read over http
    local, index = write(tmp_path, docs, name="local", sample_tokens=50, shard_bytes=3000)
    shutil.copytree(local, root / "shards")  # the same shards, served over http
    served = f"{url}/shards"
    for shuffle, workers in ((True, 2), (False, 0)):  # ranged reads; one streamed GET per shard
        make = lambda path: TokenStream(path, seq_len=9, batch_size=2, rank=1, world_size=2,
                                        seed=5, shuffle=shuffle, num_workers=workers)
        want = [b.tolist() for b in islice(make(local), 25)]
        remote = make(served)
        assert [b.tolist() for b in islice(remote, 15)] == want[:15]
        resumed = make(served)
        resumed.load_state_dict(remote.state_dict())
        assert [b.tolist() for b in islice(resumed, 10)] == want[15:]
    assert any(p.endswith(".tar") for p in RangeHandler.gets)
    os.remove(root / "shards" / index["splits"]["train"][1]["url"])
    with pytest.raises(FileNotFoundError, match="train-000001.tar"):
        TokenStream(served)
