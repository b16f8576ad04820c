"""Every file a config names is checked before a run starts or queues (scse-train --dry-run,
--plan and start-up, scse-launch, scse-study --dry-run: exit 66, one line naming the field and
what the path was resolved against); relative paths in a config file resolve against its
directory, so each shipped config runs from any directory; flags go anywhere among the
overrides of every command that takes them (docs/config.md, "Paths in config files")."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import TINY_VOCAB
from recording_backend import RecordingBackend
from scse_dist.config import load_config
from scse_dist.launch import run_job, scheduler
from scse_dist.study import cli as study_cli
from scse_dist.train.cli import main as train_main
from test_study import study, study_spec, write_spec

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
MODES = {"dry-run": ["--dry-run"], "plan": ["--plan", "--world-size", "8"], "start-up": []}
# field -> the overrides naming a missing file in it (relative: resolved against the cwd)
MISSING = {
    "train.engine.deepspeed_config": ["train.engine.deepspeed_config=missing.json"],
    "data.tokenizer": ["data.tokenizer=missing.model"],
    "data.path": ["data.path=missing/shards"],
    "data.mixture_paths[0]": ["data.mixture_weights=[1.0]", "data.mixture_paths=[missing/a]"],
    "eval.task_settings.wikitext.path": ["eval.task_settings.wikitext.path=missing/wiki.valid.raw"],
    "eval.task_settings.lambada.path": ["eval.tasks=[heldout,lambada]",
                                        "eval.task_settings.lambada.path=missing.jsonl"],
    "train.start.init_from": ["train.start.init_from=missing-export"],
    "train.start.branch_from": ["train.start.branch_from=runs/missing"],
}


def listing(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_line(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("field", MISSING)
def test_a_missing_file_is_one_line_naming_the_field_and_exit_66(tmp_path, tiny_config, capsys,
                                                                 monkeypatch, field, mode):
    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path)
    before = listing(tmp_path)
    overrides = MISSING[field]
    assert train_main(["--config", config, *MODES[mode], *overrides]) == 66
    written = overrides[-1].split("=", 1)[1].strip("[]")
    assert one_line(capsys).startswith(
        f"scse-train: error: {field}: {written!r} does not exist (resolved against {tmp_path}, "
        "the working directory)")
    assert listing(tmp_path) == before  # nothing created


def test_a_resumed_run_does_not_need_the_init_from_it_ignores(tmp_path, tiny_config, capsys):
    config = tiny_config(tmp_path, f"train.start.init_from={tmp_path / 'gone'}")
    assert train_main(["--config", config, "--dry-run"]) == 66
    assert "train.start.init_from:" in one_line(capsys)
    (tmp_path / "runs" / "tiny" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / "checkpoints" / "latest").write_text("step-0000010")
    assert train_main(["--config", config, "--dry-run"]) == 0


def write_config(path: Path, values: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


def test_paths_in_a_config_file_resolve_against_its_directory(tmp_path, tiny_config, capsys,
                                                              monkeypatch):
    """A base file's path against the base's directory, the top file's against its own, the
    command line's against the working directory."""
    tiny = yaml.safe_load(Path(tiny_config(tmp_path)).read_text())
    write_config(tmp_path / "conf/base/ds/zero.json", {})
    engine = {"deepspeed_config": "ds/zero.json"}
    write_config(tmp_path / "conf/base/base.yaml",
                 {**tiny, "train": {**tiny["train"], "engine": engine}})
    top = write_config(tmp_path / "conf/run.yaml", {"base": "base/base.yaml", "name": "run"})
    monkeypatch.chdir(tmp_path / "conf/base/ds")  # anywhere
    cfg = load_config(top)
    assert cfg.train.engine.deepspeed_config == str(tmp_path / "conf/base/ds/zero.json")
    assert train_main(["--config", top, "--dry-run"]) == 0
    assert capsys.readouterr().err == ""
    # the resolved config (what a run saves) holds the absolute path
    assert train_main(["--config", top, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["engine"]["deepspeed_config"] == \
        str(tmp_path / "conf/base/ds/zero.json")
    # a top file's own value: against the top file's directory; missing, the line says so
    write_config(tmp_path / "conf/run.yaml", {"base": "base/base.yaml", "name": "run",
                                              "train": {"engine": engine}})
    assert train_main(["--config", top, "--dry-run"]) == 66
    assert one_line(capsys) == (
        f"scse-train: error: train.engine.deepspeed_config: 'ds/zero.json' does not exist "
        f"(resolved against {tmp_path / 'conf'}, the directory of the config file that names it)")
    # on the command line: against the working directory
    assert load_config(top, ["train.engine.deepspeed_config=zero.json"]).train.engine \
        .deepspeed_config == "zero.json"
    assert train_main(["--config", top, "--dry-run",
                       "train.engine.deepspeed_config=zero.json"]) == 0


def test_a_path_found_only_from_the_working_directory_is_read_with_a_notice(
        tmp_path, tiny_config, capsys, monkeypatch):
    tiny = yaml.safe_load(Path(tiny_config(tmp_path)).read_text())
    config = write_config(tmp_path / "conf/run.yaml", {**tiny, "train": {
        **tiny["train"], "engine": {"deepspeed_config": "cwd-only.json"}}})
    write_config(tmp_path / "cwd-only.json", {})
    monkeypatch.chdir(tmp_path)
    assert train_main(["--config", config, "--dry-run"]) == 0
    (notice,) = [line for line in capsys.readouterr().err.splitlines()]
    assert notice == (
        f"config: notice: train.engine.deepspeed_config: 'cwd-only.json' is not found next to "
        f"{config} but in the working directory; read from {tmp_path / 'cwd-only.json'} for now: "
        "write it relative to the config file's directory")
    assert load_config(config).train.engine.deepspeed_config == str(tmp_path / "cwd-only.json")


def test_a_run_saved_with_a_relative_path_resumes_with_the_same_path_resolved(tmp_path,
                                                                              monkeypatch):
    from scse_dist.checkpoint.resume import refused_changes

    monkeypatch.chdir(tmp_path)
    saved = {"data": {"path": "data/shards", "mixture_paths": ["a"]}}
    now = {"data": {"path": str(tmp_path / "data/shards"), "mixture_paths": [str(tmp_path / "a")]}}
    assert refused_changes(saved, now) == []
    assert refused_changes(saved, {"data": {"path": "other", "mixture_paths": ["a"]}}) == \
        ["data.path: 'data/shards' -> 'other'"]


def shipped_overrides(config: Path, tiny_data: dict) -> list[str]:
    """Data for a config whose data must be built by hand first; nothing else changes."""
    cfg = load_config(config)
    if cfg.data.build:
        return []
    return [f"data.path={tiny_data['path']}", f"data.tokenizer={tiny_data['tokenizer']}",
            f"model.vocab_size={max(cfg.model.vocab_size, TINY_VOCAB)}"]


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.name)
def test_each_shipped_config_dry_runs_from_any_directory(config, tmp_path, tiny_data, capsys,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_main(["--config", str(config), "--dry-run",
                       *shipped_overrides(config, tiny_data)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""
    assert list(tmp_path.iterdir()) == []  # created nothing, here or for data.build
    ds = load_config(config).train.engine.deepspeed_config
    assert ds is None or Path(ds) == REPO / "configs/deepspeed" / Path(ds).name


def test_the_quickstart_data_of_a_run_from_elsewhere_goes_under_the_working_directory(
        tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_main(["--config", str(REPO / "configs/quickstart.yaml"), "--dry-run"]) == 0
    assert "data: data/quickstart/shards (not built yet; data.build=stdlib_docs builds it at " \
        "the start)" in capsys.readouterr().out


def test_scse_launch_refuses_a_missing_file_before_it_queues(tmp_path, tiny_config, capsys,
                                                            monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(scheduler, "get_backend", lambda name: backend)
    config = tiny_config(tmp_path, f"train.engine.deepspeed_config={tmp_path / 'nope.json'}")
    assert scheduler.main([config]) == 66
    assert one_line(capsys) == (f"scse-launch: error: train.engine.deepspeed_config: "
                                f"'{tmp_path / 'nope.json'}' does not exist")
    assert backend.calls == [] and not (tmp_path / "runs").exists()


def test_scse_study_dry_run_names_a_missing_file_of_the_base_config(tmp_path, tiny_config):
    base = tiny_config(tmp_path, f"train.engine.deepspeed_config={tmp_path / 'nope.json'}")
    spec = write_spec(tmp_path / "spec.yaml",
                      study_spec(base, str(tmp_path / "out"), axes={}, seeds=[0]))
    out = study(spec, "--dry-run")
    assert out.returncode == 66, out.stderr
    assert out.stderr.splitlines() == [
        f"scse-study: missing input: train.engine.deepspeed_config {tmp_path / 'nope.json'} (no "
        "such file or directory), needed by all 3 runs"]


# ------------------------------------------------------------------ flags anywhere on the line


def test_scse_train_reads_overrides_after_a_flag(tmp_path, tiny_config, capsys):
    config = tiny_config(tmp_path)
    assert train_main(["--config", config, "name=x", "--dry-run", "train.max_steps=5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run of x:") and "steps: 5," in out


def test_scse_launch_reads_overrides_after_a_flag(tmp_path, tiny_config, capsys, monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setattr(scheduler, "get_backend", lambda name: backend)
    config = tiny_config(tmp_path)
    assert scheduler.main([config, "train.max_steps=3", "--backend-args=--hold",
                           "resources.nodes=2"]) == 0
    ((_, job, _),) = backend.calls
    assert job.command[-3:] == ["train.max_steps=3", "resources.nodes=2",
                                "--schedule-evals=recording"]
    assert job.backend_args == ["--hold"]


def test_run_job_reads_overrides_after_a_flag(tmp_path, tiny_config, capsys):
    config = tiny_config(tmp_path)
    assert run_job.main(["run-dir", config, "name=a", "--schedule-evals=local",
                         f"output_dir={tmp_path / 'o'}"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'o' / 'a'}\n"


def test_scse_study_reads_overrides_after_a_flag(tmp_path, tiny_config, capsys):
    spec = write_spec(tmp_path / "spec.yaml",
                      study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={}))
    assert study_cli.main([spec, "seeds=[4]", "--dry-run", "name=t"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if str(tmp_path / "out") in r]
    assert len(rows) == 3 and all(" 4 " in r and "/t/" in r for r in rows)


def test_a_study_specs_input_paths_resolve_against_its_directory(tmp_path, tiny_config,
                                                                 tiny_data, monkeypatch):
    from scse_dist.study.runs import expand, run_config
    from scse_dist.study.spec import load_spec

    spec = study_spec(tiny_config(tmp_path), "out", axes={}, seeds=[0],
                      lr={"values": [1e-3], "validation": "eval/valid.txt"},
                      evals={"tasks": ["heldout", "lambada"], "lambada": "eval/lambada.txt"},
                      overrides={"data.path": "../shards"})
    (tmp_path / "specs").mkdir()
    path = write_spec(tmp_path / "specs" / "s.yaml", spec)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = load_spec(path)
    assert (loaded.lr.validation, loaded.evals.lambada) == (
        str(tmp_path / "specs/eval/valid.txt"), str(tmp_path / "specs/eval/lambada.txt"))
    final = [r for r in expand(loaded) if r.stage == "final"][0]
    assert run_config(loaded, final).data.path == str(tmp_path / "shards")
    # on the command line: against the working directory
    assert load_spec(path, ["overrides.data.path=x"]).overrides["data.path"] == "x"


@pytest.mark.slow  # the GPU studies plan every variant: seconds each
@pytest.mark.parametrize("spec", sorted((REPO / "configs/studies").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_each_shipped_study_dry_runs_the_same_from_any_directory(spec, tmp_path, capsys,
                                                                 monkeypatch):
    """The same table and status from the checkout's root and from elsewhere; what is missing
    here (the data a study's docs say to prepare) is named where the spec means it: the
    checkout's data/."""
    said = []
    for where in (REPO, tmp_path):
        monkeypatch.chdir(where)
        said.append((study_cli.main([str(spec), "--dry-run"]), capsys.readouterr()))
    assert said[0] == said[1]
    assert list(tmp_path.iterdir()) == []
    for line in said[0][1].err.splitlines():
        assert line.startswith("scse-study: missing input: ") and \
            line.split()[4].startswith(f"{REPO}/data/"), line
