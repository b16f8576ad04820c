"""scse-data commands and the stdlib-docstring quickstart corpus (ensure_data)."""

import gzip
import itertools
import json
import os
import textwrap

import pytest
import torch

from scse_dist.data.cli import main
from scse_dist.data.config import DataConfig
from scse_dist.data.index import read_index
from scse_dist.data.quickstart import ensure_data, stdlib_documents
from scse_dist.data.stream import TokenStream
from scse_dist.data.tokenizer import Tokenizer
from train_procs import run_ranks


def test_ensure_data_without_build_names_path_and_command(tmp_path):
    cfg = DataConfig(path=str(tmp_path / "shards"), tokenizer=str(tmp_path / "t.model"))
    with pytest.raises(FileNotFoundError) as err:
        ensure_data(cfg)
    assert str(tmp_path / "shards") in str(err.value) and "scse-data" in str(err.value)


@pytest.mark.slow
def test_data_step_builds_on_rank_0_while_the_other_rank_waits(tmp_path, subprocess_env):
    """Two ranks run the data step, as scse-train does before train(): rank 0 builds, rank 1
    builds nothing and, once the step returns, reads the shards and the tokenizer they name."""
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(f"""
        from scse_dist.config import DataConfig
        from scse_dist.data.index import read_index
        from scse_dist.data.quickstart import data_step
        from scse_dist.data.tokenizer import Tokenizer
        from scse_dist.distributed import shutdown

        cfg = DataConfig(path={str(tmp_path / "shards")!r}, tokenizer={str(tmp_path / "t.model")!r},
                         build="stdlib_docs", build_vocab_size=512)
        data_step(cfg)
        sha = read_index(cfg.path)["tokenizer_sha256"]
        print("same tokenizer:", sha == Tokenizer.load(cfg.tokenizer).sha256)
        shutdown()
    """))
    results = run_ranks([str(script)], subprocess_env, timeout=600)
    for r in results:
        assert r.returncode == 0, r.tail()
        assert r.stdout.rstrip().endswith("same tokenizer: True"), r.tail()
    assert ["quickstart:" in r.stdout for r in results] == [True, False]


@pytest.mark.slow
def test_quickstart_builds_stdlib_corpus_once(tmp_path, capsys):
    cfg = DataConfig(path=str(tmp_path / "shards"), tokenizer=str(tmp_path / "tok.model"),
                     build="stdlib_docs", build_vocab_size=512, heldout_fraction=0.05)
    ensure_data(cfg)
    printed = capsys.readouterr().out
    index = read_index(cfg.path)
    tok = Tokenizer.load(cfg.tokenizer)
    assert index["tokenizer_sha256"] == tok.sha256 and index["vocab_size"] == 512
    splits = index["splits"]
    n_docs = sum(e["documents"] for es in splits.values() for e in es)
    tokens = sum(e["tokens"] for es in splits.values() for e in es)
    assert n_docs > 300 and tokens > 200_000 and len(splits["train"]) >= 2 and splits["heldout"]
    assert f"{n_docs} documents, {tokens:,} tokens" in printed
    # real English prose: the textwrap module's docstring is in there, and it round-trips
    docs = list(stdlib_documents())
    assert len(docs) == n_docs
    assert any(d.startswith("Text wrapping and filling.") for d in docs)
    assert tok.decode(tok.encode(docs[0])) == docs[0]
    # the stream trains on it: ids within the vocabulary, eos between documents
    stream = TokenStream(cfg.path, seq_len=64, batch_size=8, tokenizer_sha256=tok.sha256)
    batches = torch.stack(list(itertools.islice(stream, 20)))
    assert batches.shape == (20, 8, 65) and int(batches.max()) < 512
    assert 0 < int((batches == tok.eos_id).sum()) < 20 * 8 * 65 / 100  # documents are long
    # a second call finds index.json and rebuilds nothing
    stamp = os.path.getmtime(os.path.join(cfg.path, "index.json"))
    ensure_data(cfg)
    assert os.path.getmtime(os.path.join(cfg.path, "index.json")) == stamp
    assert capsys.readouterr().out == ""
    # shards from an older format: the reader refuses them by name, ensure_data rebuilds them
    old = dict(index, format="scse-tokens-v1")
    with open(os.path.join(cfg.path, "index.json"), "w") as f:
        json.dump(old, f)
    with pytest.raises(ValueError, match="'scse-tokens-v1', expected 'scse-tokens-v2'.*rebuild"):
        read_index(cfg.path)
    ensure_data(cfg)
    assert read_index(cfg.path) == index and f"{n_docs} documents" in capsys.readouterr().out


def test_cli_tokenizer_shards_inspect(tmp_path, capsys):
    src = tmp_path / "docs.jsonl.gz"
    with gzip.open(src, "wt") as f:
        for i in range(120):
            f.write(json.dumps({"text": f"Document {i} talks about looped models and state "
                                        f"{i % 7}."}) + "\n")
    model, out = str(tmp_path / "t.model"), str(tmp_path / "shards")
    main(["tokenizer", "--input", str(src), "--vocab-size", "300", "--out", model])
    assert "vocab 300" in capsys.readouterr().out
    main(["shards", "--input", str(src), "--tokenizer", model, "--out", out,
          "--heldout-fraction", "0.2", "--sample-tokens", "64", "--shard-mb", "0.002"])
    summary = capsys.readouterr().out
    assert "120 documents" in summary and "docs/s" in summary and "tokens/s" in summary
    index = read_index(out)
    assert len(index["splits"]["train"]) > 1 and index["sources"] == [str(src)]
    main(["inspect", out])
    printed = capsys.readouterr().out
    held = sum(e["documents"] for e in index["splits"]["heldout"])
    assert f"heldout: {len(index['splits']['heldout'])} shards, {held:,} documents" in printed
    assert printed.strip().splitlines()[-1].startswith("OK: read 120 documents")
    # a truncated shard is caught, and the command fails
    shard = os.path.join(out, index["splits"]["train"][0]["url"])
    with open(shard, "r+b") as f:
        f.truncate(700)
    assert main(["inspect", out]) == 1
    assert "BAD train-000000.tar" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "missing")]) == 66
    assert capsys.readouterr().err == (f"scse-data: error: no shard index at "
                                       f"'{tmp_path / 'missing'}/index.json' (build shards with "
                                       "`scse-data shards` or `scse-data quickstart`)\n")


def test_zstd_jsonl_parallel_workers_and_tokenizer_options(tmp_path, capsys):
    zstandard = pytest.importorskip("zstandard")
    src = tmp_path / "web.jsonl.zst"
    lines = [json.dumps({"text": f"Page {i}: looped models <|sep|> share weights {i % 11}.",
                         "url": f"http://x/{i}"}) for i in range(200)]
    src.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    model = str(tmp_path / "t.model")
    main(["tokenizer", "--input", str(src), "--vocab-size", "320", "--out", model,
          "--model-type", "unigram", "--special-tokens", "<|sep|>", "--sample-fraction", "0.5"])
    out = capsys.readouterr().out
    docs_read = int(out.split("documents read")[0].split(",")[-1].replace(",", "").strip())
    assert docs_read == 200  # all streamed; about half kept for training (by hash)
    tok = Tokenizer.load(model)
    sep = tok.sp.piece_to_id("<|sep|>")
    assert sep > 2 and tok.encode("a <|sep|> b").count(sep) == 1
    assert tok.sp.id_to_piece(sep) == "<|sep|>"
    text = "Page 7: looped models <|sep|> share weights 7."
    assert tok.decode(tok.encode(text)) == text  # round trip
    serial, parallel = str(tmp_path / "serial"), str(tmp_path / "parallel")
    for path, workers in [(serial, "0"), (parallel, "2")]:
        main(["shards", "--input", str(src), "--tokenizer", model, "--out", path,
              "--heldout-fraction", "0.1", "--sample-tokens", "50", "--shard-mb", "0.01",
              "--workers", workers, "--progress-every", "0.000001"])
        printed = capsys.readouterr().out
        assert "200 documents" in printed and "docs/s" in printed and "tokens/s" in printed
    index = read_index(parallel)
    assert index == read_index(serial) and len(index["splits"]["train"]) > 1
    for entry in index["splits"]["train"] + index["splits"]["heldout"]:
        assert open(os.path.join(serial, entry["url"]), "rb").read() == \
            open(os.path.join(parallel, entry["url"]), "rb").read()


def test_tokenizer_sample_fraction_streams_a_stable_subset():
    from scse_dist.data.tokenizer import training_lines

    docs = [f"document number {i}" for i in range(1000)]
    half = list(training_lines(iter(docs), 10**6, sample_fraction=0.5))
    assert 420 < len(half) < 580 and set(half) < set(docs)
    assert half == list(training_lines(iter(docs), 10**6, sample_fraction=0.5))
    assert list(training_lines(iter(docs), 10**6)) == docs


def test_wikitext_articles_as_documents(tmp_path, capsys):
    """--text-split wikitext makes one document per ' = Title = ' article, sub-headings and
    blank lines inside it included; the default split would cut at every blank line."""
    articles = []
    for a in range(3):
        paragraphs = [" ".join(f"word{a}x{p}x{w} looped state" for w in range(30))
                      for p in range(4)]
        articles.append(f" = Article {a} = \n\n" + "\n\n = = Part = = \n\n".join(paragraphs)
                        + "\n\n")
    src = tmp_path / "wiki.valid.raw"
    src.write_text("".join(articles))
    model, out = str(tmp_path / "t.model"), str(tmp_path / "shards")
    main(["tokenizer", "--input", str(src), "--vocab-size", "300", "--out", model])
    main(["shards", "--input", str(src), "--tokenizer", model, "--out", out,
          "--text-split", "wikitext"])
    assert "3 documents" in capsys.readouterr().out
    docs = [Tokenizer.load(model).decode(d.tolist())
            for d in TokenStream(out, seq_len=8, batch_size=1, shuffle=False).documents()]
    assert [d.split(" = ")[1] for d in docs] == ["Article 0", "Article 1", "Article 2"]
    assert all(d.count("= = Part = =") == 3 and "word2x3x29" not in d for d in docs[:2])
    main(["shards", "--input", str(src), "--tokenizer", model, "--out", out + "2"])
    assert "3 documents" not in capsys.readouterr().out  # blank-line split: many more
    assert sum(e["documents"] for e in read_index(out + "2")["splits"]["train"]) == 3 * (1 + 4 + 3)


def test_build_rule_refuses_a_moved_path_unless_the_build_is_asked_there(tiny_data, tmp_path):
    from scse_dist.config import load_config
    from scse_dist.data.quickstart import check_build

    run = tmp_path / "run.yaml"
    run.write_text(f"data: {{path: {tmp_path}/q/shards, tokenizer: {tmp_path}/q/t.model, "
                   "build: stdlib_docs}\n")

    def check(*overrides: str) -> None:
        check_build(load_config(run, list(overrides)).data, str(run), overrides)

    typo = f"data.path={tmp_path}/typo/shards"
    for overrides in ([typo], [f"data.tokenizer={tmp_path}/x.model"],
                      ["name=y", typo, f"data.tokenizer={tmp_path}/z.model"]):
        with pytest.raises(FileNotFoundError, match="builds only into the data.path and "
                                                    "data.tokenizer that file names"):
            check(*overrides)
    # asked for on the command line, or the file's own paths: the build goes ahead
    check(typo, "data.build=stdlib_docs")
    check("train.max_steps=3")
    # a moved path that holds shards builds nothing, so there is nothing to refuse
    check(f"data.path={tiny_data['path']}", f"data.tokenizer={tiny_data['tokenizer']}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


@pytest.mark.slow
def test_mistyped_data_path_with_a_build_is_refused_and_creates_nothing(tmp_path, user_env):
    """Issue 20 item 2: quickstart.yaml (data.build: stdlib_docs) with data.path mistyped on the
    command line used to create that dir, rewrite the quickstart tokenizer and train."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    cwd = tmp_path / "project"
    cwd.mkdir()
    typo = tmp_path / "nonexistent" / "shards"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "launch" / "train.py"), "--config",
                           str(REPO_ROOT / "configs" / "quickstart.yaml"), "name=x",
                           f"data.path={typo}"],
                          capture_output=True, text=True, cwd=cwd, env=user_env, timeout=300)
    assert proc.returncode == 66, proc.stderr
    assert proc.stderr == (
        f"scse-train: error: data.path '{typo}' (on the command line) holds no shards, and "
        f"data.build=stdlib_docs in {REPO_ROOT / 'configs' / 'quickstart.yaml'} builds only into "
        "the data.path and data.tokenizer that file names; check the path, or set "
        "data.build=stdlib_docs where the path is set to build there\n")
    assert proc.stdout == ""
    assert sorted(tmp_path.iterdir()) == [cwd] and list(cwd.iterdir()) == []  # nothing written
