"""scse-eval --exit: quality under an exit rule with the steps each scored token used."""

import json

import pytest
import torch

from scse_dist.checkpoint.export import load_exported_model
from scse_dist.eval.cli import main
from scse_dist.eval.exit_stats import ExitStats
from scse_dist.eval.task_run import run_task
from scse_dist.model import parse_exit_rule
from test_eval_cli import export_and_shards  # noqa: F401 (the fixture)
from test_eval_tasks import LAMBADA, export  # noqa: F401 (the fixture)


def test_exit_stats_mean_percentiles_and_histogram():
    stats = ExitStats(parse_exit_rule("motion:0.1,max=8"))
    stats.add(torch.tensor([[1, 2, 8], [2, 2, 3]]), torch.tensor([[True, True, True],
                                                                   [True, True, False]]))
    stats.add(torch.tensor([[4]]))
    row = stats.summary()
    assert row["steps_histogram"] == {"1": 1, "2": 3, "4": 1, "8": 1}
    assert row["mean_steps"] == pytest.approx((1 + 2 * 3 + 4 + 8) / 6)
    assert (row["steps_p10"], row["steps_p50"], row["steps_p90"], row["steps_p99"]) == (1, 2, 8, 8)
    assert row["exit"] == "motion:0.1,max=8" and stats.depth([1, 4]) == 8
    assert ExitStats(parse_exit_rule("kl:0.1")).depth([1, 4]) == 4


def _heldout(checkpoint, shards, root, *extra):
    out = root / "exit.json"
    assert main(["--checkpoint", checkpoint, "--task", "heldout", "--data", shards,
                 "--out", str(out),
                 "--batch-size", "2", "--max-batches", "3", "--seq-len", "8", *extra]) == 0
    return json.loads(out.read_text())["results"]


def test_cli_exit_fixed_equals_the_plain_depth(export_and_shards, capsys):  # noqa: F811
    checkpoint, shards, root = export_and_shards
    plain = _heldout(checkpoint, shards, root, "--depths", "4")
    [fixed] = _heldout(checkpoint, shards, root, "--depths", "1,4", "--exit", "fixed")
    assert fixed["loss"] == plain[0]["loss"] and fixed["depth"] == 4
    assert fixed["mean_steps"] == 4 and fixed["steps_histogram"] == {"4": 48}
    [motion] = _heldout(checkpoint, shards, root, "--exit", "motion:0.5,max=6")
    printed = capsys.readouterr().out
    assert motion["depth"] == 6 and motion["exit"] == "motion:0.5,max=6"
    assert sum(motion["steps_histogram"].values()) == motion["tokens"] == 48
    assert 1 <= motion["steps_p10"] <= motion["steps_p50"] <= motion["steps_p90"] <= 6
    assert "exit motion:0.5,max=6" in printed and "mean_steps" in printed
    assert "steps per token: " in printed


def test_lambada_with_exit_fixed_equals_the_plain_depth(export, tmp_path):  # noqa: F811
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    model, cfg = load_exported_model(export[0])
    [plain] = run_task("lambada", model, cfg, str(path), [3], str(tmp_path / "a.json"), "x")
    [fixed] = run_task("lambada", model, cfg, str(path), [1], str(tmp_path / "b.json"), "x",
                       exit_rule=parse_exit_rule("fixed,max=3"))
    assert {k: fixed[k] for k in plain} == plain
    assert fixed["steps_histogram"] == {"3": plain["target_tokens"]}


@pytest.mark.parametrize("argv, message", [
    (["--task", "heldout", "--exit", "speed:1"],
     "argument --exit: exit rule 'speed:1': unknown kind 'speed'"),
    (["--task", "diagnose", "--exit", "motion:0.1"], "--exit: diagnose measures the loop"),
])
def test_cli_rejects_bad_exit(export_and_shards, capsys, argv, message):  # noqa: F811
    checkpoint, shards, root = export_and_shards
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", checkpoint, "--data", shards, "--out", str(root / "x.json"), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
