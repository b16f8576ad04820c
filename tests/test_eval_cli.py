"""scse-eval end to end: tiny exported model (its tokenizer included: eval compares it with the
shards') + tiny shard dir -> table on stdout + results JSON."""

import json

import pytest
import torch

from conftest import TINY_VOCAB
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.config import config_from_dict
from scse_dist.data.index import read_index
from scse_dist.data.stream import TokenStream
from scse_dist.eval.cli import main
from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.eval.results import format_table
from scse_dist.model import LoopedLM


@pytest.fixture(scope="module")
def export_and_shards(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("eval_cli")
    cfg = config_from_dict({"name": "tiny", "data": {"seq_len": 16},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 32, "depth": 2}})
    torch.manual_seed(0)
    export = save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(root / "export"),
                                 tokenizer=tiny_data["tokenizer"])
    assert read_index(tiny_data["path"])["splits"]["heldout"]
    return export, tiny_data["path"], root


def test_cli_writes_table_and_json(export_and_shards, capsys):
    export, shards, root = export_and_shards
    out = root / "results.json"
    assert main(["--checkpoint", export, "--task", "heldout", "--data", shards, "--depths", "4,1",
                 "--out", str(out), "--batch-size", "2", "--max-batches", "3",
                 "--seq-len", "8"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["task"] == "heldout" and data["checkpoint"] == export
    assert (data["recurrence"], data["residual"]) == ("scse", "deeploop")
    assert data["seq_len"] == 8 and data["batch_size"] == 2 and data["max_batches"] == 3
    assert [r["depth"] for r in data["results"]] == [1, 4]
    assert all(r["tokens"] == 3 * 2 * 8 for r in data["results"])

    # the numbers equal an in-process evaluation of the loaded export on the same stream
    model, _ = load_exported_model(export)
    stream = TokenStream(shards, split="heldout", seq_len=8, batch_size=2, loop=False)
    expected = evaluate_heldout(model, stream, [1, 4], max_batches=3)
    for got, want in zip(data["results"], expected):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert format_table(data["results"]) in printed


@pytest.mark.parametrize("argv, message", [
    (["--task", "perplexity"], "argument --task: invalid choice: 'perplexity'"),
    (["--task", "heldout", "--depths", "1,x"],
     "argument --depths: expected comma-separated integers"),
    (["--task", "heldout", "--depths", "0,4"], "argument --depths: depths must be integers >= 1"),
    (["--task", "heldout", "--seq-len", "64"], "--seq-len 64 exceeds the model's max_seq_len=32"),
])
def test_cli_rejects_bad_arguments(export_and_shards, capsys, argv, message):
    export, shards, root = export_and_shards
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", export, "--data", shards, "--out", str(root / "x.json"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (root / "x.json").exists()


def test_cli_refuses_shards_from_a_bigger_vocabulary(export_and_shards, tmp_path, capsys):
    export, shards, _ = export_and_shards
    index = read_index(shards)
    index["vocab_size"] = 4096
    big = tmp_path / "big"
    big.mkdir()
    (big / "index.json").write_text(json.dumps(index))
    assert main(["--checkpoint", export, "--task", "heldout", "--data", str(big),
                 "--out", str(tmp_path / "r.json")]) == 65
    assert capsys.readouterr().err == (f"scse-eval: error: {big}: shards were written with "
                                       "vocab_size=4096, more than the model's "
                                       f"model.vocab_size={TINY_VOCAB}\n")
