"""Report: results JSONs of several runs -> markdown table (task x depth), frontier PNG, wandb."""

import json
import time

import pytest

from scse_dist.config import config_from_dict
from scse_dist.eval.report import collect, markdown_table, write_report
from scse_dist.eval.results import write_results
from scse_dist.study.report_cli import main


def _run(root, name, recurrence, ppl_by_depth, accuracy_by_depth=None):
    cfg = config_from_dict({"name": name, "model": {"recurrence": recurrence}})
    run = root / name
    write_results(run / "eval" / "heldout.json", "heldout", f"{name}@step-1", cfg,
                  [{"depth": t, "loss": 1.0, "ppl": v, "tokens": 10}
                   for t, v in ppl_by_depth.items()])
    if accuracy_by_depth:
        write_results(run / "eval" / "lambada.json", "lambada", f"{name}@step-1", cfg,
                      [{"depth": t, "accuracy": a, "ppl": 9.0, "loss": 2.0}
                       for t, a in accuracy_by_depth.items()])
    (run / "eval" / "notes.json").write_text('{"not": "a result"}')  # ignored
    return run


def test_table_has_one_row_per_run_task_metric_and_a_column_per_depth(tmp_path):
    scse = _run(tmp_path, "scse", "scse", {1: 40.0, 8: 20.5}, {1: 0.125, 8: 0.25})
    untied = _run(tmp_path, "untied", "untied", {4: 30.0})
    table = markdown_table(collect([scse, untied])).splitlines()
    assert table[0] == "| run | task | metric | T=1 | T=4 | T=8 |"
    assert table[2] == "| scse (scse) | heldout | ppl | 40.0000 |  | 20.5000 |"
    assert table[3] == "| scse (scse) | lambada | accuracy | 0.1250 |  | 0.2500 |"
    assert table[4] == "| scse (scse) | lambada | ppl | 9.0000 |  | 9.0000 |"
    assert table[5] == "| untied (untied) | heldout | ppl |  | 30.0000 |  |"
    assert len(table) == 6


def test_partial_results_are_marked_in_the_table(tmp_path):
    run = _run(tmp_path, "scse", "scse", {1: 40.0})
    cfg = config_from_dict({"name": "scse"})
    write_results(run / "eval" / "lambada.json", "lambada", "x", cfg,
                  [{"depth": 1, "accuracy": 0.5, "ppl": 9.0}],
                  extra={"partial": {"done": 1264, "total": 5153, "unit": "passage"}})
    table = markdown_table(collect([run])).splitlines()
    assert table[3] == "| scse (scse) | lambada (partial: 1264/5153 passage) | accuracy | 0.5000 |"
    assert table[2] == "| scse (scse) | heldout | ppl | 40.0000 |"


def test_report_writes_markdown_and_a_valid_png(tmp_path, capsys):
    import matplotlib.image

    runs = [_run(tmp_path, "scse", "scse", {1: 40.0, 2: 30.0, 8: 20.0}, {1: 0.1, 8: 0.3}),
            _run(tmp_path, "additive", "additive", {1: 41.0, 2: 35.0, 8: 60.0})]
    assert main([*map(str, runs), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "| additive (additive) | heldout | ppl | 41.0000 | 35.0000 | 60.0000 |" in report
    png = (tmp_path / "rep" / "frontier.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(tmp_path / "rep" / "frontier.png"))
    assert image.shape[0] > 100 and image.shape[1] > 200
    assert image[..., :3].std() > 0.01  # lines drawn, not a blank canvas
    assert "| scse (scse) | lambada | accuracy |" in capsys.readouterr().out


def test_eval_rows_of_training_give_a_held_out_curve_per_depth(tmp_path, capsys):
    import matplotlib.image

    from scse_dist.eval.curves import eval_rows, loss_by_depth

    with_rows = _run(tmp_path, "scse", "scse", {1: 40.0, 4: 20.0})
    rows = [{"step": 10, "loss": 5.0}, {"step": 10, "kind": "eval", "task": "heldout",
                                        "heldout_loss_T1": 4.0, "heldout_loss_T4": 3.5},
            {"step": 20, "kind": "eval", "task": "heldout", "heldout_loss_T1": 3.0,
             "heldout_loss_T4": 2.0}, {"step": 20, "kind": "sample", "text": "x"}]
    (with_rows / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"st')
    assert [r["step"] for r in eval_rows(with_rows)] == [10, 20]
    assert loss_by_depth(eval_rows(with_rows)) == {1: [(10, 4.0), (20, 3.0)],
                                                   4: [(10, 3.5), (20, 2.0)]}
    without = _run(tmp_path, "additive", "additive", {1: 41.0})
    assert main([str(with_rows), str(without), "--out", str(tmp_path / "rep")]) == 0
    assert "heldout_curve.png" in capsys.readouterr().out
    assert "![held-out loss during training](heldout_curve.png)" in \
        (tmp_path / "rep" / "report.md").read_text()
    image = matplotlib.image.imread(str(tmp_path / "rep" / "heldout_curve.png"))
    assert image.shape[1] > 200 and image[..., :3].std() > 0.01
    # runs without evaluation rows: no curve, and the report does not mention one
    assert main([str(without), "--out", str(tmp_path / "rep2")]) == 0
    assert not (tmp_path / "rep2" / "heldout_curve.png").exists()
    assert "heldout_curve" not in (tmp_path / "rep2" / "report.md").read_text()


def test_a_run_without_results_and_a_broken_json_are_named(tmp_path):
    (tmp_path / "empty" / "eval").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="empty: no evaluation results"):
        collect([tmp_path / "empty"])
    run = _run(tmp_path, "x", "scse", {1: 2.0})
    (run / "eval" / "broken.json").write_text('{"task": ')
    with pytest.raises(ValueError, match="broken.json: not a results JSON"):
        collect([run])


def test_report_numbers_go_to_an_offline_wandb_run_in_the_group(tmp_path, monkeypatch):
    from scse_dist.train.metrics_config import WandbConfig

    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, "scse", "scse", {1: 40.0, 8: 20.0})
    write_report([run], tmp_path / "out", WandbConfig(mode="offline", group="g1"),
                 wandb_name="scse-eval", wandb_group="g1")
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb's service process may still be writing the file when finish() returns: wait for it.
    log, deadline = next(runs[0].glob("*.wandb")), time.monotonic() + 60
    while b"heldout/ppl@T8" not in (blob := log.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"heldout/ppl@T8" in blob and b"g1" in blob  # summary numbers, in the group
    table = json.loads(next(runs[0].glob("files/media/table/eval/results_*.table.json"))
                       .read_text())
    assert table["columns"] == ["run", "task", "metric", "depth", "value"]
    assert table["data"] == [["scse (scse)", "heldout", "ppl", 1, 40.0],
                             ["scse (scse)", "heldout", "ppl", 8, 20.0]]


def test_downstream_rows_of_training_give_a_curve_per_task_and_depth(tmp_path, capsys):
    import matplotlib.image

    from scse_dist.eval.curves import downstream_by_depth, eval_rows

    run = _run(tmp_path, "scse", "scse", {1: 40.0, 4: 20.0})
    rows = [{"step": 10, "loss": 5.0},
            {"step": 10, "kind": "downstream", "arc_easy_acc_norm_T1": 0.25,
             "arc_easy_accuracy_T1": 0.3, "arc_easy_acc_norm_T4": 0.3, "lambada_accuracy_T1": 0.1,
             "lambada_ppl_T1": 90.0, "arc_easy_examples": 8, "downstream_time_s": 1.0},
            {"step": 20, "kind": "downstream", "arc_easy_acc_norm_T1": 0.5,
             "arc_easy_acc_norm_T4": 0.75, "lambada_accuracy_T1": 0.2, "lambada_ppl_T1": 50.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # each task's headline (arc_easy: acc_norm, lambada: accuracy), tasks in registry order
    assert downstream_by_depth(eval_rows(run, "downstream")) == {
        "lambada": {1: [(10, 0.1), (20, 0.2)]},
        "arc_easy": {1: [(10, 0.25), (20, 0.5)], 4: [(10, 0.3), (20, 0.75)]}}
    assert main([str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "downstream_curve.png" in capsys.readouterr().out
    assert "![downstream tasks during training](downstream_curve.png)" in \
        (tmp_path / "rep" / "report.md").read_text()
    image = matplotlib.image.imread(str(tmp_path / "rep" / "downstream_curve.png"))
    assert image.shape[1] > 600 and image[..., :3].std() > 0.01  # two panels, lines drawn
    # a run without downstream rows: no curve
    other = _run(tmp_path, "additive", "additive", {1: 41.0})
    assert main([str(other), "--out", str(tmp_path / "rep2")]) == 0
    assert not (tmp_path / "rep2" / "downstream_curve.png").exists()
