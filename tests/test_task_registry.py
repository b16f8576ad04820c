"""Adding an eval task is one record plus its reader and scorer: a toy task registered here (and
nowhere else) is accepted by config validation, run by `scse-eval --task toy` and by the
launcher's evaluation job, and shown in a run's report and in a study report with the direction
its record gives."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import tiny_config_dict
from scse_dist.checkpoint.export import save_exported_model
from scse_dist.cli_errors import InputError
from scse_dist.config import config_from_dict, load_config, save_config
from scse_dist.eval.cli import main as scse_eval
from scse_dist.eval.config import task_files
from scse_dist.eval.report import report_run
from scse_dist.eval.results import write_results
from scse_dist.launch import run_job
from scse_dist.model import LoopedLM
from scse_dist.study.report import write_study_report
from scse_dist.task_registry import TASKS, Task
from scse_dist.typed_yaml import ConfigError
from test_study_report import write_run, write_study

LINES = ["the cat sees the red ball", "a small bird reads", "my sister paints the blue river"]


def read_toy(path: str) -> list[str]:
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise InputError(f"{path}: no lines")
    return lines


@dataclass
class ToyConfig:
    """The toy task's own settings: eval.task_settings.toy."""

    path: Optional[str] = None  # its data file
    lines: int = 0  # score only the first `lines` lines (0: all)


def score_toy(run) -> list[dict]:
    """Per depth: the NLL of each line's first token right after EOS, and how often it is the
    argmax, over the first run.settings.lines lines."""
    lines = run.inputs[:run.settings.lines or None]
    first = torch.tensor([run.tokenizer.encode(line)[0] for line in lines])
    eos = torch.full((len(first), 1), run.tokenizer.eos_id)
    rows = []
    with torch.inference_mode():
        for depth in run.depths:
            logits = run.model(eos, depth=depth).logits[:, -1].float()
            rows.append({"depth": depth, "first_nll": F.cross_entropy(logits, first).item(),
                         "first_hit": (logits.argmax(-1) == first).float().mean().item(),
                         "lines": len(first)})
    run.extra["toy_lines"] = len(first)
    return rows


# The functions themselves, as a module of scse_dist/eval/tasks/ registers its own.
TOY = Task("toy", reader=read_toy, scorer=score_toy,
           metrics=("first_nll", "first_hit"),
           table=("first_nll", "first_hit"), report=("first_nll", "first_hit"),
           higher_is_better=("first_hit",), settings=ToyConfig)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(TASKS, "toy", TOY)
    return TOY


def _config(tiny_data, tmp_path, **eval_fields):
    values = tiny_config_dict(tiny_data, str(tmp_path / "runs"))
    values["eval"].update(eval_fields)
    return values


def test_config_accepts_a_registered_task_and_asks_for_its_data(tiny_data, tmp_path, monkeypatch):
    values = _config(tiny_data, tmp_path, tasks=["heldout", "toy"])
    with pytest.raises(ConfigError, match=r"^eval.tasks\[1\]: must be one of heldout, validation, "
                                          r"wikitext, lambada, diagnose, hellaswag, piqa, "
                                          r"arc_easy, arc_challenge, multiple_choice; got 'toy'$"):
        config_from_dict(values)
    monkeypatch.setitem(TASKS, "toy", TOY)
    with pytest.raises(ConfigError, match="^eval.task_settings.toy.path: eval.tasks lists 'toy', "
                                          "so set eval.task_settings.toy.path to its data file$"):
        config_from_dict(values)
    with pytest.raises(ConfigError, match=r"got 'tyo' \(did you mean 'toy'\?\)$"):
        config_from_dict(_config(tiny_data, tmp_path, tasks=["tyo"]))
    values["eval"]["task_settings"] = {"toy": {"path": "toy.txt", "lines": 2}}
    assert config_from_dict(values).eval.settings("toy") == ToyConfig("toy.txt", 2)
    values["eval"]["task_settings"] = {"toy": {"path": "toy.txt", "line": 2}}
    with pytest.raises(ConfigError, match=r"^eval.task_settings.toy.line: unknown field \(did you "
                                          r"mean 'lines'\?\)$"):
        config_from_dict(values)


@pytest.fixture
def toy_run(tiny_data, tmp_path, toy):
    """A run dir as training leaves it (config.yaml, export/) whose config lists the toy task."""
    data = tmp_path / "toy.txt"
    data.write_text("\n".join(LINES) + "\n")
    cfg = config_from_dict(_config(tiny_data, tmp_path, tasks=["heldout", "toy"],
                                   task_settings={"toy": {"path": str(data), "lines": 2}}))
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(0)
    model = LoopedLM(cfg.model).eval()
    save_exported_model(model.state_dict(), cfg, str(run_dir / "export"))
    return run_dir, model, cfg


def _expected(model, tokenizer_path, depth):
    from scse_dist.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_path)
    with torch.no_grad():
        logp = model(torch.tensor([[tok.eos_id]]), depth=depth).logits[0, -1].float() \
            .log_softmax(-1)
    return -sum(float(logp[tok.encode(line)[0]]) for line in LINES[:2]) / 2


def test_scse_eval_and_the_launcher_run_the_task_and_the_run_report_shows_it(toy_run, tmp_path,
                                                                             capsys):
    run_dir, model, cfg = toy_run
    out = tmp_path / "cli.json"
    assert scse_eval(["--checkpoint", str(run_dir / "export"), "--task", "toy", "--data",
                      cfg.eval.settings("toy").path, "--depths", "1,2", "--out", str(out),
                      "--device", "cpu"]) == 0
    assert "| depth | first_nll | first_hit |" in capsys.readouterr().out  # the record's table
    by_cli = json.loads(out.read_text())
    assert by_cli["task"] == "toy" and by_cli["toy_lines"] == 2  # its own setting, lines: 2
    for row in by_cli["results"]:
        assert row["lines"] == 2
        assert row["first_nll"] == pytest.approx(_expected(model, cfg.data.tokenizer, row["depth"]),
                                                 rel=1e-5)
    # the launcher's evaluation job (evaluate_export): the export's config says where the toy
    # data is (eval.task_settings.toy.path)
    assert run_job.main(["evaluate", str(run_dir), "toy"]) == 0
    assert capsys.readouterr().out.endswith(f"scse-launch: toy: {run_dir / 'eval' / 'toy.json'}\n")
    by_launcher = json.loads((run_dir / "eval" / "toy.json").read_text())
    assert by_launcher["data"] == cfg.eval.settings("toy").path and "max_batches" not in by_launcher
    assert by_launcher["results"] == by_cli["results"]
    report = Path(report_run(str(run_dir))["report"]).read_text()
    row = by_cli["results"][0], by_cli["results"][1]
    assert f"| tiny (scse) | toy | first_nll | {row[0]['first_nll']:.4f} | " \
           f"{row[1]['first_nll']:.4f} |" in report


def test_a_study_report_shows_the_task_with_its_direction(tmp_path, toy):
    """Variant scse hits more (first_hit, higher is better) and has a higher NLL (lower is
    better) than additive at every seed: better on one, worse on the other."""
    study = tmp_path / "toy-study"
    entries = []
    for seed in range(3):
        for variant, shift in (("scse", 0.2 + 0.01 * seed), ("additive", 0.0)):
            entry = write_run(study, variant, seed, heldout={1: 30.0, 2: 20.0})
            run_dir = study / entry["run_dir"]
            cfg = load_config(run_dir / "config.yaml")
            write_results(run_dir / "eval" / "toy.json", "toy", "x", cfg,
                          [{"depth": t, "first_nll": 2.0 + shift + 0.1 * t,
                            "first_hit": 0.3 + shift} for t in (1, 2)])
            entries.append(entry)
    write_study(study, entries, variants={"scse": {}, "additive": {}}, seeds=[0, 1, 2],
                pairs=[["scse", "additive"]])
    report = write_study_report(study, wandb_mode="disabled").read_text()
    assert "## toy first_nll (lower is better)" in report
    assert "## toy first_hit (higher is better)" in report
    numbers = json.loads((study / "report" / "aggregate.json").read_text())
    assert numbers["aggregate"]["scse/toy/first_hit"]["1"]["mean"] == pytest.approx(0.51)
    assert numbers["paired"]["scse - additive/toy/first_hit"]["verdict"] == "better at all depths"
    assert numbers["paired"]["scse - additive/toy/first_nll"]["verdict"] == "worse at all depths"


def test_a_study_spec_takes_the_task_its_data_and_report_metrics(tmp_path, tiny_config, toy):
    from scse_dist.study.plan import _inputs
    from scse_dist.study.runs import expand, run_config
    from scse_dist.study.spec import SpecError, parse_spec

    data = str(tmp_path / "toy.txt")
    spec = {"name": "s", "out": str(tmp_path / "out"), "base": tiny_config(tmp_path),
            "variants": {"scse": {}}, "seeds": [0],
            "evals": {"tasks": ["heldout", "toy"], "depths": [1, 2], "data": {"toy": data}},
            "report": {"metrics": {"toy": ["first_hit"]}}}
    parsed = parse_spec(spec, "spec.yaml")
    (run,) = expand(parsed)
    assert run_config(parsed, run).eval.settings("toy") == ToyConfig(data)
    assert _inputs(parsed, run)["eval.task_settings.toy.path"] == data  # --dry-run checks it
    spec["report"] = {"metrics": {"toy": ["first_hits"]}}
    with pytest.raises(SpecError, match=r"report.metrics.toy: 'first_hits' is not a metric of toy "
                                        r"\(did you mean 'first_hit'\?\)"):
        parse_spec(spec, "spec.yaml")


BUILT_IN = ["heldout", "validation", "wikitext", "lambada", "diagnose", "hellaswag", "piqa",
            "arc_easy", "arc_challenge", "multiple_choice"]


def test_each_built_in_task_is_one_module_that_registers_it():
    """A built-in task's scorer and its record are in one module of scse_dist.eval.tasks (its
    reader there too, or a corpus reader of scse_dist.data.sources), imported, not named."""
    from scse_dist.eval.tasks import multiple_choice

    assert list(TASKS) == BUILT_IN
    for name in BUILT_IN:
        own = "multiple_choice" if name in multiple_choice.READERS else \
            "heldout" if name == "validation" else name  # heldout's scorer on its own text
        module = f"scse_dist.eval.tasks.{own}"
        task = TASKS[name]
        assert task.scorer.__module__ == module, name
        assert task.reader.__module__ in (module, "scse_dist.data.sources"), name
        for fn in (task.totals, task.from_totals):
            assert fn is None or fn.__module__ in (module, "scse_dist.eval.task_run"), name


def test_reading_the_registry_loads_every_task_without_torch(subprocess_env):
    """Config validation and `scse-eval --help` read the registry before any model loads."""
    import subprocess
    import sys

    code = ("import sys; from scse_dist.task_registry import TASKS; "
            "print(','.join(TASKS), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [",".join(BUILT_IN), "False"]


def test_no_module_of_eval_imports_a_private_name_of_another():
    """The helpers tasks share are public: no `from x import _name` under scse_dist/eval/."""
    import ast

    root = Path(__file__).resolve().parents[1] / "scse_dist" / "eval"
    private = [f"{path.relative_to(root)}: {node.module}.{alias.name}"
               for path in sorted(root.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
               if isinstance(node, ast.ImportFrom) and node.module
               for alias in node.names if alias.name.startswith("_")]
    assert len(list(root.rglob("*.py"))) > 10 and private == []


def test_the_old_per_task_keys_load_with_one_notice_each_as_the_new_ones(tiny_data, tmp_path,
                                                                          monkeypatch, capsys):
    """eval.wikitext, eval.lambada, eval.stride and eval.data.<task>, in a file and as
    overrides: the same settings as eval.task_settings, and one notice per old name."""
    from scse_dist import typed_yaml

    monkeypatch.setattr(typed_yaml, "_noticed", set())
    new = _config(tiny_data, tmp_path, tasks=["heldout", "wikitext", "piqa"], task_settings={
        "wikitext": {"path": "w.raw", "stride": 7}, "lambada": {"path": "l.txt"},
        "piqa": {"path": "p.jsonl"}, "hellaswag": {"path": "h.jsonl"}})
    old = _config(tiny_data, tmp_path, tasks=["heldout", "wikitext", "piqa"], wikitext="w.raw",
                  lambada="l.txt", stride=7, data={"piqa": "p.jsonl", "hellaswag": "h.jsonl"})
    path, new_path = tmp_path / "old.yaml", tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(old))
    new_path.write_text(yaml.safe_dump(new))
    expected = load_config(new_path).eval  # both files' paths resolve against their directory
    assert capsys.readouterr().err == ""
    assert load_config(path).eval == expected
    # a command line's path is as typed (the working directory's): absolute here
    assert load_config(path, [f"eval.data.piqa={tmp_path / 'p.jsonl'}", "eval.stride=7"]).eval \
        == expected
    notices = capsys.readouterr().err.splitlines()
    assert notices == [f"config: notice: {o} is now {n}; the old name is read for now" for o, n in
                       (("eval.wikitext", "eval.task_settings.wikitext.path"),
                        ("eval.lambada", "eval.task_settings.lambada.path"),
                        ("eval.stride", "eval.task_settings.wikitext.stride"),
                        ("eval.data.<task>", "eval.task_settings.<task>.path"))]
    assert task_files(expected) == {"eval.task_settings.wikitext.path": str(tmp_path / "w.raw"),
                                    "eval.task_settings.lambada.path": str(tmp_path / "l.txt"),
                                    "eval.task_settings.piqa.path": str(tmp_path / "p.jsonl"),
                                    "eval.task_settings.hellaswag.path": str(tmp_path / "h.jsonl")}
    with pytest.raises(ConfigError, match=r"^eval.task_settings.wikitext.stride: must be >= 0, "
                                          r"got -1$"):
        config_from_dict(_config(tiny_data, tmp_path, task_settings={"wikitext": {"stride": -1}}))
    with pytest.raises(ConfigError, match=r"^eval.task_settings.heldout: heldout has no settings"):
        config_from_dict(_config(tiny_data, tmp_path, task_settings={"heldout": {}}))
