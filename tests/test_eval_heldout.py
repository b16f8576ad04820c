"""Held-out evaluation: per-depth NLL from one pass, results JSON, table, and scse-eval."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_cfg
from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.eval.results import format_table, write_results
from scse_dist.model import LoopedLM


def token_batches(sizes, seq_len=8, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, seq_len + 1), generator=g) for b in sizes]


def manual_nll(model, batches, depth):
    """Summed token NLL and token count from a separate forward at `depth` per batch."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch[:, :-1], depth=depth).logits
            total += F.cross_entropy(logits.flatten(0, 1).double(), batch[:, 1:].flatten(),
                                     reduction="sum").item()
            count += batch[:, 1:].numel()
    return total, count


@pytest.mark.parametrize("recurrence", ["scse", "additive"])
def test_one_pass_matches_separate_forwards_per_depth(recurrence):
    model = LoopedLM(tiny_cfg(recurrence=recurrence).model).eval()
    batches = token_batches([3, 3, 1])  # ragged last batch: weighted by its real token count
    rows = evaluate_heldout(model, batches, depths=[3, 1, 2])
    assert [r["depth"] for r in rows] == [1, 2, 3]
    for row in rows:
        total, count = manual_nll(model, batches, row["depth"])
        assert row["tokens"] == count == 7 * 8
        assert row["loss"] == pytest.approx(total / count, rel=1e-5)
        assert row["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # the depths really differ, so the check above cannot pass by reading one depth three times
    assert len({round(r["loss"], 6) for r in rows}) == 3


def test_max_batches_and_training_mode_restored():
    model = LoopedLM(tiny_cfg().model).train()
    batches = token_batches([2, 2, 2])
    (row,) = evaluate_heldout(model, iter(batches), depths=[2], max_batches=1)
    assert model.training
    total, count = manual_nll(model.eval(), batches[:1], 2)
    assert row["tokens"] == count == 16
    assert row["loss"] == pytest.approx(total / count, rel=1e-5)


def test_untied_is_evaluated_at_its_own_depth(capsys):
    model = LoopedLM(tiny_cfg(recurrence="untied", residual="preln").model).eval()
    assert isinstance(model.fixed_depth, int)
    batches = token_batches([2])
    rows = evaluate_heldout(model, batches, depths=[1, 8])
    assert [r["depth"] for r in rows] == [model.fixed_depth]
    assert f"evaluating depth {model.fixed_depth} only" in capsys.readouterr().out
    total, count = manual_nll(model, batches, None)
    assert rows[0]["loss"] == pytest.approx(total / count, rel=1e-5)


def test_bad_depths_and_empty_split_are_errors():
    model = LoopedLM(tiny_cfg().model)
    with pytest.raises(ValueError, match="depths: need a non-empty list of depths >= 1"):
        evaluate_heldout(model, token_batches([1]), depths=[0, 2])
    with pytest.raises(ValueError, match="held no tokens"):
        evaluate_heldout(model, [], depths=[2])


# --------------------------------------------------------------------------- results


ROWS = [{"depth": 8, "loss": 4.5, "ppl": math.exp(4.5), "tokens": 100},
        {"depth": 1, "loss": 5.25, "ppl": math.exp(5.25), "tokens": 100}]


def test_results_json_round_trip(tmp_path):
    cfg = tiny_cfg(recurrence="additive", residual="preln")
    path = write_results(tmp_path / "sub" / "r.json", "heldout", "runs/x/export", cfg, ROWS,
                         extra={"data": "shards/", "diverged": float("nan")})
    data = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert path.endswith("r.json")
    assert data["task"] == "heldout" and data["checkpoint"] == "runs/x/export"
    assert (data["run"], data["recurrence"], data["residual"]) == ("tiny", "additive", "preln")
    assert data["results"] == ROWS
    assert data["config"]["model"]["d_model"] == 32
    assert data["data"] == "shards/" and data["diverged"] is None  # non-finite -> null
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["r.json"]
    with pytest.raises(ValueError, match=r"extra keys \['task'\]"):
        write_results(tmp_path / "r2.json", "heldout", "x", cfg, ROWS, extra={"task": "other"})


def test_format_table_is_fixed_width_sorted_by_depth():
    table = format_table(ROWS)
    assert table.splitlines() == [
        "| depth |      ppl |   loss |",
        "|------:|---------:|-------:|",
        "|     1 | 190.5663 | 5.2500 |",
        "|     8 |  90.0171 | 4.5000 |",
    ]
    assert format_table(ROWS, metrics=("tokens",)).splitlines()[2] == "|     1 |    100 |"
