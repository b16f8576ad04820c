"""The three tokenizer kinds (sentencepiece .model, Hugging Face tokenizer.json, tiktoken ranks)
behind one interface, each built here from small files (no network): a byte-level BPE trained by
`scse-data tokenizer --kind byte-bpe`, a Llama-style (Metaspace, `<s>`/`</s>`, a BOS-adding
template) tokenizer.json, a tiktoken ranks file with its settings and one named after an OpenAI
encoding. Kind detection, ids, EOS/BOS, lossless round trips, worker pickling, shards, word ppl
and bits per byte against a direct computation, export files and kind, and (slow) transformers'
AutoTokenizer on each kind's export giving our ids.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import WITHOUT_SCSE_DIST, tiny_documents
from scse_dist.checkpoint.export import load_export_config, save_exported_model
from scse_dist.config import config_from_dict
from scse_dist.data.cli import main as data_main
from scse_dist.data.index import iter_samples, read_index, shard_url
from scse_dist.data.shards import write_shards
from scse_dist.data.tokenizer import Tokenizer, detect_kind, train_tokenizer
from scse_dist.eval.task_run import document_rows
from scse_dist.generate.text import continuation_text
from scse_dist.model import LoopedLM

TEXTS = ["the cat sees a green box today.", "  Two  spaces,\ttabs\nand lines.  ",
         "Grüße aus Köln — naïve café, 東京, emoji 😀 and <|endoftext|> </s> as text."]
# tiktoken's GPT-2 pattern, written out so the test states what it relies on
R50K_PAT = (r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")
MERGES = [b"th", b"he", b"the", b" the", b"in", b"er", b" a", b"at", b" c", b"at."]


def write_ranks(path: Path, settings: dict | None) -> str:
    ranks = [bytes([b]) for b in range(256)] + MERGES
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    if settings is not None:
        Path(str(path) + ".json").write_text(json.dumps(settings))
    return str(path)


def llama_style(path: Path) -> str:
    """A Metaspace BPE with <unk>, <s>, </s> and a post-processor that adds <s>, as Llama's."""
    from tokenizers import (
        Tokenizer as HFTok,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(tiny_documents(100), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, str]:
    """{name: tokenizer file} for every kind (and a second tokenizer.json and ranks file)."""
    root = tmp_path_factory.mktemp("kinds")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in tiny_documents(300)))
    data_main(["tokenizer", "--kind", "byte-bpe", "--input", str(corpus), "--vocab-size", "400",
               "--out", str(root / "bbpe.json")])
    tiktoken_settings = {"pat_str": R50K_PAT, "special_tokens": {"<|endoftext|>": 300}}
    return {"sentencepiece": train_tokenizer(tiny_documents(300), 320, str(root / "sp.model")),
            "byte-bpe": str(root / "bbpe.json"), "llama": llama_style(root / "tokenizer.json"),
            "tiktoken": write_ranks(root / "tiny.tiktoken", tiktoken_settings),
            "cl100k": write_ranks(root / "cl100k_base.tiktoken", None)}


KIND_OF = {"sentencepiece": "sentencepiece", "byte-bpe": "hf", "llama": "hf",
           "tiktoken": "tiktoken", "cl100k": "tiktoken"}
# (eos, bos): sentencepiece 2/1; the byte-level BPE's <|endoftext|> is id 0 and both; Llama's
# </s> and <s>; the ranks' stated <|endoftext|>; cl100k_base's own 100257
SPECIAL = {"sentencepiece": (2, 1), "byte-bpe": (0, 0), "llama": (2, 1), "tiktoken": (300, 300),
           "cl100k": (100257, 100257)}


@pytest.mark.parametrize("name", list(KIND_OF))
def test_each_kind_loads_encodes_and_round_trips(kinds, name):
    tok = Tokenizer.load(kinds[name])
    assert tok.kind == KIND_OF[name] == detect_kind(Path(kinds[name]).read_bytes())
    assert Tokenizer.load(kinds[name], KIND_OF[name]).sha256 == tok.sha256
    assert (tok.eos_id, tok.bos_id) == SPECIAL[name]
    lossless = TEXTS if name != "llama" else TEXTS[:1]  # Metaspace without byte fallback: <unk>
    for text in lossless:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids and tok.bos_id not in ids  # nothing added; "</s>" is text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    again = pickle.loads(pickle.dumps(tok))  # what shard workers receive
    assert (type(again), again.sha256, again.encode(TEXTS[2])) == \
        (type(tok), tok.sha256, tok.encode(TEXTS[2]))
    # the generated text after a prompt is the decode of what was added
    prompt, full = tok.encode("the cat"), tok.encode("the cat sees a box")
    assert full[:len(prompt)] == prompt
    assert continuation_text(tok, prompt, [*full[len(prompt):], tok.eos_id]) == " sees a box"


def test_tiktoken_settings_come_from_the_file_or_the_encoding_name(kinds):
    tok = Tokenizer.load(kinds["tiktoken"])
    assert tok.vocab_size == 301 and tok.encode("the cat") == [256 + MERGES.index(b"the"),
                                                               256 + MERGES.index(b" c"),
                                                               256 + MERGES.index(b"at")]
    named = Tokenizer.load(kinds["cl100k"])
    import tiktoken_ext.openai_public as public

    assert named.settings["special_tokens"]["<|endofprompt|>"] == 100276
    assert named.settings["pat_str"] != R50K_PAT and named.vocab_size == 100277
    assert named.sha256 != tok.sha256  # same ranks, another pattern: another tokenizer
    # the constructors' network loaders are back in place
    assert public.load_tiktoken_bpe.__module__ == "tiktoken.load"


def test_bad_tokenizer_files_are_one_line_each(tmp_path, kinds):
    def error(path, kind="auto"):
        with pytest.raises(ValueError) as err:
            Tokenizer.load(str(path), kind)
        return str(err.value)

    unknown = write_ranks(tmp_path / "mine.tiktoken", None)
    assert "pattern and special tokens are not stated: write " + unknown + ".json" in \
        error(unknown)
    bad = write_ranks(tmp_path / "eos.tiktoken",
                      {"pat_str": R50K_PAT, "special_tokens": {"<x>": 300}})
    assert "eos_token '<|endoftext|>' is not one of the special_tokens ['<x>']" in error(bad)
    (tmp_path / "short.tiktoken").write_bytes(b"YQ== 0\nYg== 1\n")
    assert "the ranks lack 254 of the 256 single-byte tokens" in \
        error(tmp_path / "short.tiktoken", "tiktoken")
    (tmp_path / "line.tiktoken").write_bytes(b"YQ== 0\nnot a line\n")
    assert f"tokenizer {tmp_path}/line.tiktoken:2: not a `base64-token rank` line" in \
        error(tmp_path / "line.tiktoken")
    (tmp_path / "x.json").write_text('{"not": "a tokenizer"}')
    assert f"tokenizer {tmp_path}/x.json: not a Hugging Face tokenizers JSON file" in \
        error(tmp_path / "x.json")
    no_eos = json.loads(Path(kinds["llama"]).read_text())
    no_eos["added_tokens"] = [t for t in no_eos["added_tokens"] if t["content"] != "</s>"]
    del no_eos["model"]["vocab"]["</s>"]
    (tmp_path / "noeos.json").write_text(json.dumps(no_eos))
    assert "no end-of-text token (none of <|endoftext|>, </s>" in error(tmp_path / "noeos.json")
    assert "not a sentencepiece model" in error(kinds["byte-bpe"], "sentencepiece")
    assert "tokenizer kind 'bpe': expected auto or one of sentencepiece, hf, tiktoken" in \
        error(kinds["byte-bpe"], "bpe")


def test_a_missing_package_is_one_line_naming_the_extra(kinds, monkeypatch):
    from scse_dist.typed_yaml import ConfigError

    for module, name in (("tiktoken", "tiktoken"), ("tokenizers", "byte-bpe")):
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
        with pytest.raises(ConfigError, match=rf"needs the '{module}' package: pip install "
                                              rf"'scse-dist\[{module}\]'"):
            Tokenizer.load(kinds[name])

def test_byte_bpe_command_refuses_sentencepiece_options(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("some text\n")
    status = data_main(["tokenizer", "--kind", "byte-bpe", "--input", str(tmp_path / "c.txt"),
                        "--vocab-size", "300", "--out", str(tmp_path / "t.json"),
                        "--model-type", "unigram"])
    assert status == 2 and "--model-type: a sentencepiece option" in capsys.readouterr().err
    status = data_main(["tokenizer", "--kind", "byte-bpe", "--input", str(tmp_path / "c.txt"),
                        "--vocab-size", "200", "--out", str(tmp_path / "t.json")])
    assert status == 2 and "vocab_size: 200 is too small for a byte-level BPE" in \
        capsys.readouterr().err


def _direct_nll(model: LoopedLM, ids: list[int], eos: int) -> float:
    """The document's summed NLL from one forward of EOS + ids (what eval must reproduce)."""
    seq = torch.tensor([[eos, *ids]])
    with torch.no_grad():
        logits = model(seq[:, :-1], depth=2).logits[0].double()
    return float(torch.nn.functional.cross_entropy(logits, seq[0, 1:], reduction="sum"))


@pytest.mark.parametrize("name", ["sentencepiece", "byte-bpe", "tiktoken"])
def test_shards_and_bits_per_byte_per_kind(kinds, name, tmp_path):
    tok = Tokenizer.load(kinds[name])
    docs = tiny_documents(30, seed=3) + TEXTS
    # workers > 1: the tokenizer pickles into spawned processes; the same shards as in-process
    for workers in (0, 2) if name != "sentencepiece" else (0,):
        out = str(tmp_path / f"shards{workers}")
        write_shards(docs, tok, out, workers=workers, sample_tokens=64)
        index = read_index(out)
        assert (index["tokenizer_sha256"], index["eos_id"], index["vocab_size"]) == \
            (tok.sha256, tok.eos_id, tok.vocab_size)
        read: list[int] = []
        for entry in index["splits"]["train"]:
            for _, tokens, _ in iter_samples(shard_url(out, entry), tok.eos_id, tok.vocab_size):
                read += tokens.tolist()
        assert read == [t for d in docs for t in [*tok.encode(d), tok.eos_id]]
    cfg = config_from_dict({"model": {"vocab_size": max(tok.vocab_size, 320), "d_model": 32,
                                      "n_heads": 2, "max_seq_len": 512, "depth": 2}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    row = document_rows(model, tok, TEXTS, [2], seq_len=512, stride=512, batch_size=2)[0]
    # each document is scored stripped; its bytes are the raw text's (lm-eval's convention,
    # tests/test_eval_conventions.py)
    nll = sum(_direct_nll(model, tok.encode(t.strip()), tok.eos_id) for t in TEXTS)
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    words = sum(len(t.split()) for t in TEXTS)
    assert (row["bytes"], row["words"]) == (n_bytes, words)
    assert row["tokens"] == sum(len(tok.encode(t.strip())) for t in TEXTS)
    assert row["bits_per_byte"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-6)
    assert row["word_ppl"] == pytest.approx(math.exp(nll / words), rel=1e-6)


def _tiny_export(tokenizer: str, root: Path, vocab: int) -> Path:
    cfg = config_from_dict({"name": "k", "data": {"seq_len": 32, "tokenizer": tokenizer},
                            "model": {"vocab_size": vocab, "d_model": 32, "n_heads": 2,
                                      "max_seq_len": 32, "depth": 2}})
    torch.manual_seed(0)
    return Path(save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(root),
                                    tokenizer=tokenizer))


EXPORTED = {"sentencepiece": ["tokenizer.model"], "hf": ["tokenizer.json"],
            "tiktoken": ["tokenizer.tiktoken", "tokenizer.tiktoken.json"]}


@pytest.fixture(scope="module")
def exports(kinds, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {name: _tiny_export(kinds[name], root / name, 512)
            for name in ("sentencepiece", "byte-bpe", "llama", "tiktoken")}


def test_export_carries_the_tokenizer_and_names_its_kind(kinds, exports):
    for name, path in exports.items():
        kind = KIND_OF[name]
        names = {p.name for p in path.iterdir() if p.name.startswith("tokenizer.")}
        assert names == set(EXPORTED[kind]), name
        cfg = load_export_config(path)
        assert (cfg.data.tokenizer, cfg.data.tokenizer_kind) == \
            (str(path / EXPORTED[kind][0]), kind)
        assert Tokenizer.load(cfg.data.tokenizer, kind).sha256 == Tokenizer.load(kinds[name]).sha256
        config = json.loads((path / "config.json").read_text())
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        assert config["scse_tokenizer_kind"] == tokenizer_config["scse_tokenizer_kind"] == kind
        assert config["eos_token_id"] == SPECIAL[name][0]


CHILD = WITHOUT_SCSE_DIST + r"""
import json
from transformers import AutoTokenizer
job = json.load(open(sys.argv[1]))
out = {}
for name, path in job["exports"].items():
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    plain = [tok(t, add_special_tokens=False)["input_ids"] for t in job["texts"]]
    batch = tok(job["texts"][:2], padding=True)
    tok.save_pretrained(path + "-resaved")
    again = AutoTokenizer.from_pretrained(path + "-resaved", trust_remote_code=True)
    out[name] = {"plain": plain, "default": [tok(t)["input_ids"] for t in job["texts"]],
                 "decoded": [tok.decode(ids, skip_special_tokens=True) for ids in plain],
                 "batch": batch["input_ids"], "mask": batch["attention_mask"],
                 "again": [again(t, add_special_tokens=False)["input_ids"] for t in job["texts"]],
                 "eos": tok.eos_token_id, "pad": tok.pad_token_id}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_auto_tokenizer_gives_our_ids_for_each_kind(kinds, exports, tmp_path):
    texts = [TEXTS[0], "a cat sees the box.", TEXTS[1], TEXTS[2]]
    job = {"exports": {n: str(p) for n, p in exports.items()}, "texts": texts}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "job.json"),
                          str(tmp_path / "out.json")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    hf = json.loads((tmp_path / "out.json").read_text())
    for name in exports:
        tok, res = Tokenizer.load(kinds[name]), hf[name]
        ours = [tok.encode(t) for t in texts]
        assert res["plain"] == ours == res["again"], name
        # a prompt starts after an EOS, as every document in training: EOS in front, nothing
        # else (not Llama's own <s>)
        assert res["default"] == [[tok.eos_id, *ids] for ids in ours], name
        assert (res["eos"], res["pad"]) == (tok.eos_id,) * 2
        if name != "llama":  # Metaspace decodes "  Two" as " Two" (no byte fallback)
            assert res["decoded"] == texts, name
        width = max(len(ids) + 1 for ids in ours[:2])
        assert res["batch"] == [[tok.eos_id] * (width - len(ids) - 1) + [tok.eos_id, *ids]
                                for ids in ours[:2]]  # left-padded with EOS
        assert res["mask"] == [[0] * (width - len(ids) - 1) + [1] * (len(ids) + 1)
                               for ids in ours[:2]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["byte-bpe", "tiktoken"])
def test_train_export_eval_and_generate_with_a_kind(kinds, name, tiny_config, tmp_path,
                                                    subprocess_env):
    """Shards of the kind, 4 training steps (the run's export carries the tokenizer and names its
    kind), scse-eval's wikitext (word ppl and bits per byte from the export's tokenizer) and
    heldout, and scse-generate's text, all through the commands."""
    from train_procs import TRAIN

    tok = Tokenizer.load(kinds[name])
    shards = str(tmp_path / "shards")
    write_shards(tiny_documents(200), tok, shards, heldout_fraction=0.1, sample_tokens=512)
    kind = KIND_OF[name]
    cfg = tiny_config(tmp_path, "name=k", "train.max_steps=4", f"data.path={shards}",
                      f"data.tokenizer={kinds[name]}", f"data.tokenizer_kind={kind}",
                      "model.vocab_size=512", "train.checkpoint.every=4")
    env = {**subprocess_env, "PATH": os.path.dirname(sys.executable) + os.pathsep +
           os.environ.get("PATH", "")}

    def run(*argv: str) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=300,
                             cwd=tmp_path)
        assert out.returncode == 0, f"{argv}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        return out

    run(sys.executable, TRAIN, "--config", cfg)
    export = tmp_path / "runs" / "k" / "export"
    assert (export / EXPORTED[kind][0]).is_file()
    assert load_export_config(export).data.tokenizer_kind == kind
    wiki = tmp_path / "wiki.raw"
    wiki.write_text(" \n = A Story = \n \n The cat sees a green box . Grüße 😀 \n")
    run("scse-eval", "--checkpoint", str(export), "--task", "wikitext", "--data", str(wiki),
        "--depths", "1,2", "--out", str(tmp_path / "w.json"))
    rows = json.loads((tmp_path / "w.json").read_text())["results"]
    from scse_dist.data.sources import read_wikitext_articles

    [text] = read_wikitext_articles(str(wiki))
    assert [r["bytes"] for r in rows] == [len(text.encode())] * 2
    assert [r["tokens"] for r in rows] == [len(tok.encode(text.strip()))] * 2
    for r in rows:
        assert r["bits_per_byte"] * math.log(2) * r["bytes"] == \
            pytest.approx(r["loss"] * r["tokens"], rel=1e-9)
    run("scse-eval", "--checkpoint", str(export), "--task", "heldout", "--data", shards,
        "--depths", "2", "--out", str(tmp_path / "h.json"))
    assert json.loads((tmp_path / "h.json").read_text())["results"][0]["tokens"] > 0
    out = run("scse-generate", str(export), "--prompt", "The cat", "--max-new-tokens", "6")
    assert out.stdout.startswith("The cat")
    # lm-eval's scse model reads the export's tokenizer of this kind: a rolling loglikelihood is
    # scse-eval's document NLL with the same windows
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from scse_dist.checkpoint.export import load_exported_model
    from scse_dist.lmeval.model import ScseLM

    lm = ScseLM(str(export), device="cpu")
    assert (lm.tokenizer.kind, lm.tokenizer_name) == (kind, tok.sha256)
    model, _ = load_exported_model(export)
    row = document_rows(model, tok, [text], [lm.depth], lm.max_length, lm.stride, 4)[0]
    rolling, = lm.loglikelihood_rolling([SimpleNamespace(args=(text.strip(),),
                                                         task_name="t")])
    assert rolling == pytest.approx(-row["loss"] * row["tokens"], rel=1e-6)
