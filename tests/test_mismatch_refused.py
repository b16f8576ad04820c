"""Mismatches a command can see are refused in one line with a documented exit status, and the
files around them are left as they were (issue 38, cases 2, 4 and 5): an export scoring shards of
another tokenizer, corrupt shards (ids past the vocabulary, a tar with nothing readable), a dry
run or plan of a run that would not start, a path from an export's or checkpoint's config, and a
reader of stdout that goes away. Every command runs from a directory outside the checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import console_script, tiny_config_dict, tiny_documents

BAD_INPUT, NO_INPUT = 65, 66  # scse_dist.cli_errors


def listing(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots`: the before/after picture of what a command touched."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(Path(root).rglob("*")) if p.is_file()}


def refused(proc: subprocess.CompletedProcess, status: int, *texts: str) -> str:
    """The one stderr line of a refused command, checked: its status, no traceback, the texts."""
    context = f"rc {proc.returncode}\nstderr: {proc.stderr[-3000:]}"
    assert proc.returncode == status, context
    assert "Traceback" not in proc.stderr, context
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, context
    for text in texts:
        assert text in lines[0], context
    return lines[0]


def flip_first_token(tar: Path) -> None:
    """The first token of the shard's first sample becomes 65535, past any tiny vocabulary."""
    data = bytearray(tar.read_bytes())
    magic = data.index(b"\x93NUMPY")
    start = magic + 10 + int.from_bytes(data[magic + 8:magic + 10], "little")
    data[start:start + 2] = b"\xff\xff"
    tar.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_data):
    """Exports of the tiny model (one carrying another tokenizer, one whose config names relative
    data paths), a checkpoint dir whose config names a relative tokenizer, and shards with a token
    id past the vocabulary; all outside the checkout."""
    import torch

    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.config import config_from_dict, config_to_dict
    from scse_dist.data.tokenizer import train_tokenizer
    from scse_dist.model import LoopedLM

    d = tmp_path_factory.mktemp("mismatch")
    other = str(d / "other.model")  # a real tokenizer, not the shards' own
    train_tokenizer(tiny_documents(80, seed=1), 300, other)
    values = tiny_config_dict(tiny_data, str(d / "runs"))
    cfg = config_from_dict(values)
    torch.manual_seed(0)
    weights = LoopedLM(cfg.model).state_dict()
    exports = d / "exports"
    paths = {
        "d": d, "other": other,
        "export": save_exported_model(weights, cfg, str(exports / "good"),
                                      tokenizer=tiny_data["tokenizer"]),
        "export_other": save_exported_model(weights, cfg, str(exports / "other"), tokenizer=other),
        "export_relative": save_exported_model(
            weights, config_from_dict({**values, "data": {**values["data"],
                                                          "path": "data/quickstart/shards"}}),
            str(exports / "relative"), tokenizer=tiny_data["tokenizer"]),
    }
    # a DeepSpeed checkpoint dir as far as scse-export reads it before the weights: its tag's
    # config names the tokenizer relative to where the run was launched
    tag = d / "run" / "checkpoints" / "step-0000001"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text(tag.name)
    saved = config_to_dict(cfg)
    saved["data"]["tokenizer"] = "data/web/tokenizer.model"
    (tag / "config.json").write_text(json.dumps(saved))
    paths["run"] = d / "run"
    # held-out shards whose first sample holds an id past the vocabulary
    flipped = shutil.copytree(tiny_data["path"], d / "flipped")
    index = json.loads((flipped / "index.json").read_text())
    paths["flipped_tar"] = flipped / index["splits"]["heldout"][0]["url"]
    flip_first_token(paths["flipped_tar"])
    paths["flipped"] = flipped
    return paths


@pytest.fixture
def elsewhere(tmp_path):
    """An experiment directory outside the checkout, empty."""
    where = tmp_path / "experiment"
    where.mkdir()
    return where


def run(command: str, argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(console_script(command) + [str(a) for a in argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_eval_refuses_shards_of_another_tokenizer_than_the_exports(inputs, tiny_data, elsewhere,
                                                                   subprocess_env):
    """Case 2: no --tokenizer given, the export's own tokenizer is compared with the shards'."""
    before = listing(inputs["d"], Path(tiny_data["path"]), elsewhere)
    proc = run("scse-eval", ["--checkpoint", inputs["export_other"], "--task", "heldout",
                             "--data", tiny_data["path"], "--out", "x.json"],
               elsewhere, subprocess_env)
    line = refused(proc, BAD_INPUT, f"{tiny_data['path']}/index.json: the shards were written "
                                    "with another tokenizer")
    assert f"the model's ({inputs['export_other']}/tokenizer.model) has" in line
    assert listing(inputs["d"], Path(tiny_data["path"]), elsewhere) == before  # x.json not written


def test_eval_names_the_exports_config_and_the_flag_for_a_data_path_from_it(inputs, elsewhere,
                                                                            subprocess_env):
    before = listing(inputs["d"], elsewhere)
    proc = run("scse-eval", ["--checkpoint", inputs["export_relative"], "--task", "heldout",
                             "--out", "x.json"], elsewhere, subprocess_env)
    refused(proc, NO_INPUT, "'data/quickstart/shards' does not exist here",
            f"data.path of the config of {inputs['export_relative']}; --data names another")
    assert listing(inputs["d"], elsewhere) == before


def test_export_advises_tokenizer_for_a_relative_tokenizer_of_the_checkpoints_config(
        inputs, elsewhere, subprocess_env):
    before = listing(inputs["d"], elsewhere)
    proc = run("scse-export", [inputs["run"], "--out", "x"], elsewhere, subprocess_env)
    line = refused(proc, NO_INPUT, "'data/web/tokenizer.model' does not exist here",
                   "data.tokenizer of the config of", "--tokenizer names another")
    assert "scse-data tokenizer" not in line  # it exists: no advice to train another
    assert listing(inputs["d"], elsewhere) == before


def test_eval_of_a_token_id_past_the_vocabulary_is_one_line_naming_shard_and_sample(
        inputs, elsewhere, subprocess_env):
    """Case 4: a flipped byte gives an id past the vocabulary: exit 65 naming the shard and the
    sample, not an IndexError from the embedding; held-out perplexity never skips a sample."""
    before = listing(inputs["d"], elsewhere)
    proc = run("scse-eval", ["--checkpoint", inputs["export"], "--task", "heldout",
                             "--data", inputs["flipped"], "--out", "x.json"],
               elsewhere, subprocess_env)
    refused(proc, BAD_INPUT, f"{inputs['flipped_tar']}: sample 0: token id 65535 past the "
                             "vocabulary (vocab_size 320)")
    assert listing(inputs["d"], elsewhere) == before


@pytest.mark.slow  # starts the trainer (DeepSpeed imports) until its first batch
def test_training_on_shards_with_nothing_readable_is_a_data_error(tiny_data, tiny_config,
                                                                   tmp_path, subprocess_env):
    """Case 4: every train tar truncated so that no sample is readable: exit 65 and one error line
    (after one skip line per shard), never "rank 0 crashed", which the launcher would retry."""
    shards = shutil.copytree(tiny_data["path"], tmp_path / "shards")
    for entry in json.loads((shards / "index.json").read_text())["splits"]["train"]:
        tar = shards / entry["url"]
        tar.write_bytes(tar.read_bytes()[:700])  # the first member's header and a little more
    config = tiny_config(tmp_path, f"data.path={shards}", "train.max_steps=2")
    before = listing(shards)
    proc = run("scse-train", ["--config", config], tmp_path, subprocess_env)
    assert proc.returncode == BAD_INPUT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "crashed" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("scse-train:")]
    assert len(errors) == 1 and "found no readable data in split 'train'" in errors[0], errors
    assert listing(shards) == before


def dry_run(tmp_path, monkeypatch, capsys, config: str, *argv: str) -> tuple[int, str, str]:
    from scse_dist.train.cli import main

    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    status = main(["--config", config, *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("flags", [["--dry-run"], ["--plan", "--world-size", "8"]])
def test_dry_run_and_plan_exit_with_the_status_the_run_would_have(tmp_path, tiny_config,
                                                                  tiny_data, monkeypatch, capsys,
                                                                  flags):
    """Case 5: `--dry-run && sbatch ...` queues no doomed job: 0 only for a run that would
    start, else the run's own status and its one line, after the report."""
    config = tiny_config(tmp_path)
    before = listing(tmp_path, Path(tiny_data["path"]))
    status, out, err = dry_run(tmp_path, monkeypatch, capsys, config, *flags)
    assert (status, err) == (0, "")
    if flags == ["--dry-run"]:
        assert out.endswith(f"data: {tiny_data['path']} (present and readable)\n")
    for override, expected, text in [
            (f"data.path={tmp_path}/missing", NO_INPUT, f"{tmp_path}/missing"),
            ("model.vocab_size=64", BAD_INPUT, f"data.tokenizer: {tiny_data['tokenizer']} has "
                                               "320 tokens, more than model.vocab_size=64"),
            (f"data.path={tmp_path}/qs/shards data.tokenizer={tmp_path}/qs/tok.model "
             "data.build=stdlib_docs model.vocab_size=64", BAD_INPUT,
             "data.build_vocab_size=4096: the tokenizer the build trains has more pieces than "
             "model.vocab_size=64")]:
        status, out, err = dry_run(tmp_path, monkeypatch, capsys, config, *flags,
                                   *override.split())
        assert status == expected, (override, err)
        assert out  # the report or the plan, as before
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("scse-train: error: ") and \
            text in lines[0], (override, err)
    assert listing(tmp_path, Path(tiny_data["path"])) == before  # nothing created or changed


def test_a_reader_of_stdout_that_goes_away_is_silent_and_exit_0(tiny_data, elsewhere,
                                                                subprocess_env):
    """`scse-data inspect ... | head`: the pipe is closed before anything is written, so every
    write fails with EPIPE; a tool ends quietly then."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(console_script("scse-data") + ["inspect", tiny_data["path"]],
                              cwd=elsewhere, env=subprocess_env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert list(elsewhere.iterdir()) == []


def test_study_dry_run_exits_with_the_status_its_runs_would_have(tmp_path, tiny_config,
                                                                 tiny_data):
    from test_study import study, study_spec, write_spec

    spec = study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={})
    spec["variants"]["looped"]["overrides"]["model.vocab_size"] = 64
    path = write_spec(tmp_path / "spec.yaml", spec)
    before = listing(tmp_path)
    out = study(path, "--dry-run", cwd=tmp_path)
    assert out.returncode == BAD_INPUT and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.splitlines() == [
        f"scse-study: data.tokenizer: {tiny_data['tokenizer']} has 320 tokens, more than "
        "model.vocab_size=64 (exit 65), for 3 run(s): looped-seed0, looped-seed1, looped-seed2"]
    assert listing(tmp_path) == before


def test_a_broken_pipe_elsewhere_than_stdout_stays_an_error(subprocess_env):
    """Only stdout's reader going away is silent: a broken pipe to a child or a socket, with
    stdout still read, is one line and exit 66 like any unreadable input."""
    code = ("import sys\nfrom scse_dist.cli_errors import cli_main\n"
            "@cli_main('scse-x')\ndef main(argv=None):\n"
            "    print('some output')\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        NO_INPUT, "some output\n", "scse-x: error: [Errno 32] Broken pipe\n")
