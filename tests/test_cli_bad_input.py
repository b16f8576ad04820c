"""Bad input at every command: a documented exit status and exactly one line on stderr that names
the file (file:line where there is one), never a traceback.

Each row of CASES is one real process of a console script (or `python launch/train.py`). They
all start together in one module fixture, a few at a time, since each spends most of its life
importing; the tests then check one result each. No network: unreachable URLs point at
127.0.0.1:1 and at fsspec's in-memory filesystem.
"""

from __future__ import annotations

import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import (
    REPO_ROOT,
    console_script,
    run_profiling_imports,
    tiny_config_dict,
    tiny_documents,
)

BAD_CONFIG, BAD_INPUT, NO_INPUT = 2, 65, 66  # scse_dist.cli_errors

# (command, arguments, exit status, text the one line must contain). In the arguments and the
# text, {d} is the folder of bad inputs, {export} a tiny exported model, {shards} and {tok} the
# session's tiny shards and their tokenizer, {other} a tokenizer the shards were not written
# with, {config} a good run config (runs go under {d}), {broken} an export with corrupt weights.
CASES = {
    "data": [
        ("tokenizer --input {d}/empty.txt --vocab-size 300 --out {d}/t.model", BAD_INPUT,
         "{d}/empty.txt: no documents"),
        ("shards --input {d}/empty.jsonl --tokenizer {tok} --out {d}/s", BAD_INPUT,
         "{d}/empty.jsonl: no documents"),
        ("shards --input {d}/binary.txt --tokenizer {tok} --out {d}/s", BAD_INPUT,
         "{d}/binary.txt:2: not UTF-8 text (byte 0x98"),
        ("shards --input {d}/bad.jsonl --tokenizer {tok} --out {d}/s", BAD_INPUT,
         "{d}/bad.jsonl:2: not valid JSON"),
        ("shards --input {d}/nofield.jsonl --tokenizer {tok} --out {d}/s", BAD_INPUT,
         "{d}/nofield.jsonl:1: no field 'text'"),
        ("shards --input {d}/missing.jsonl --tokenizer {tok} --out {d}/s", NO_INPUT,
         "{d}/missing.jsonl"),
        ("shards --input http://127.0.0.1:1/x.jsonl --tokenizer {tok} --out {d}/s", NO_INPUT,
         "http://127.0.0.1:1/x.jsonl"),
        ("shards --input memory://nope/x.jsonl --tokenizer {tok} --out {d}/s", NO_INPUT,
         "memory://nope/x.jsonl"),
        ("shards --input {d}/good.jsonl --tokenizer {d}/binary.txt --out {d}/s", BAD_INPUT,
         "tokenizer {d}/binary.txt: not a sentencepiece model"),
        ("shards --input {d}/good.jsonl --tokenizer {d}/missing.model --out {d}/s", NO_INPUT,
         "{d}/missing.model"),
        ("inspect {d}/missing", NO_INPUT, "{d}/missing/index.json"),
    ],
    "eval": [
        ("--task lambada --data {d}/empty.jsonl", BAD_INPUT, "{d}/empty.jsonl: no passages"),
        ("--task lambada --data {d}/binary.txt", BAD_INPUT, "{d}/binary.txt:2: not UTF-8 text"),
        ("--task lambada --data {d}/bad.jsonl", BAD_INPUT, "{d}/bad.jsonl:2: not valid JSON"),
        ("--task lambada --data {d}/nofield.jsonl", BAD_INPUT,
         "{d}/nofield.jsonl:1: expected an object with a string field 'text'"),
        ("--task lambada --data {d}/missing.jsonl", NO_INPUT, "{d}/missing.jsonl"),
        ("--task heldout --data {d}/run-noeval", NO_INPUT,
         "input '{d}/run-noeval' is a directory, not a text or JSONL file (a shard directory "
         "holds index.json)"),
        ("--task heldout --data http://127.0.0.1:1/x.jsonl", NO_INPUT, "http://127.0.0.1:1/x.jsonl"),
        ("--task lambada --data memory://nope/x.jsonl", NO_INPUT, "memory://nope/x.jsonl"),
        ("--task lambada --data {d}/good.jsonl --tokenizer {d}/binary.txt", BAD_INPUT,
         "tokenizer {d}/binary.txt: not a sentencepiece model"),
        ("--task heldout --data {shards} --tokenizer {other}", BAD_INPUT,
         "{shards}/index.json: the shards were written with another tokenizer"),
        # the data is read before the weights: a broken export is not what the line reports
        ("--task lambada --data {d}/bad.jsonl --checkpoint {broken}", BAD_INPUT,
         "{d}/bad.jsonl:2: not valid JSON"),
        ("--task lambada --data {d}/good.jsonl --checkpoint {broken}", BAD_INPUT,
         "{broken}/model.safetensors' is not a readable safetensors export"),
    ],
    "train": [
        ("--config {d}/missing.yaml", BAD_CONFIG, "{d}/missing.yaml' does not exist"),
        ("--config {d}/binary.txt", BAD_CONFIG, "{d}/binary.txt' is not UTF-8 text"),
        ("--config {d}/bad.yaml", BAD_CONFIG, "{d}/bad.yaml:2: not valid YAML"),
        ("--config {d}/typo.yaml", BAD_CONFIG,
         "train.max_step: unknown field (did you mean 'max_steps'?) (in {d}/typo.yaml)"),
        ("--config {config} train.max_step=3", BAD_CONFIG,
         "train.max_step: unknown field (did you mean 'max_steps'?) (on the command line: "
         "train.max_step=3)"),
        ("--config {config} data.path={d}/missing", NO_INPUT, "{d}/missing"),
        ("--config {config} data.tokenizer={d}/binary.txt", BAD_INPUT,
         "tokenizer {d}/binary.txt: not a sentencepiece model"),
        ("--config {config} data.tokenizer={other}", BAD_INPUT,
         "{shards}/index.json: the shards were written with another tokenizer"),
        # a callback of the user's own: imported before torch, named in one line ({{ }}: braces)
        ('--config {config} train.callbacks.mine.class_path=no_such_mod:Cb', BAD_CONFIG,
         "train.callbacks.mine.class_path: 'no_such_mod:Cb': cannot import no_such_mod (No module "
         "named 'no_such_mod')"),
        ('--config {config} train.callbacks.mine.class_path=json:JSONDecoder', BAD_CONFIG,
         "train.callbacks.mine.class_path: 'json:JSONDecoder' is not a subclass of "
         "scse_dist.train.callbacks.Callback"),
        # a built-in's setting: checked before torch too
        ('--config {config} train.callbacks.heldout_eval.init_args.every_steps=-1', BAD_CONFIG,
         "train.callbacks.heldout_eval.init_args.every_steps: must be >= 0, got -1"),
    ],
    "launch/train.py": [
        ("--config {d}/bad.yaml", BAD_CONFIG, "{d}/bad.yaml:2: not valid YAML"),
        ("--config {config} data.tokenizer={d}/missing.model", NO_INPUT, "{d}/missing.model"),
    ],
    "report": [
        ("{d}/run-noeval --out {d}/rep", NO_INPUT, "{d}/run-noeval: no evaluation results"),
        ("{d}/run-empty --out {d}/rep", BAD_INPUT,
         "{d}/run-empty/eval/heldout.json: not a results JSON"),
        ("{d}/run-binary --out {d}/rep", BAD_INPUT,
         "{d}/run-binary/eval/heldout.json: not a results JSON (not UTF-8"),
        ("{d}/run-bad --out {d}/rep", BAD_INPUT,
         "{d}/run-bad/eval/heldout.json: not a results JSON (Expecting"),
        ("{d}/run-nodepth --out {d}/rep", BAD_INPUT,
         "{d}/run-nodepth/eval/heldout.json: field 'results' must be a list of objects"),
    ],
    "export": [
        ("{d}/missing --out {d}/x", NO_INPUT, "checkpoint '{d}/missing' does not exist"),
        ("{d} --out {d}/x", NO_INPUT, "'{d}' is neither an export"),
    ],
    "generate": [
        ("{d}/missing --prompt x", NO_INPUT, "checkpoint '{d}/missing' does not exist"),
        ("{broken} --prompt x", BAD_INPUT, "is not a readable safetensors export"),
        ("{export} --prompt-file {d}/missing.txt", NO_INPUT, "{d}/missing.txt"),
        ("{export} --prompt-file {d}/binary.txt", BAD_INPUT, "{d}/binary.txt: not UTF-8 text"),
    ],
    "launch": [
        ("{d}/missing.yaml --local", BAD_CONFIG, "{d}/missing.yaml' does not exist"),
        ("{d}/typo.yaml --local", BAD_CONFIG, "train.max_step: unknown field"),
        ("{config} data.tokenizer={d}/binary.txt --local", BAD_INPUT,
         "tokenizer {d}/binary.txt: not a sentencepiece model"),
    ],
}
# The cases whose bad input is only found by loading the weights (with torch).
LOADS_WEIGHTS = {"--task lambada --data {d}/good.jsonl --checkpoint {broken}",
                 "{broken} --prompt x"}
SCRIPTS = {"data": "scse-data", "eval": "scse-eval", "train": "scse-train", "report": "scse-report",
           "launch": "scse-launch", "export": "scse-export", "generate": "scse-generate"}
IDS = [(command, i) for command, rows in CASES.items() for i in range(len(rows))]


def _command(name: str) -> list[str]:
    """The console script (of the venv running the tests, or its entry point), or
    launch/train.py."""
    if name == "launch/train.py":
        return [sys.executable, str(REPO_ROOT / "launch" / "train.py")]
    return console_script(SCRIPTS[name])


def _write_inputs(d: Path, tiny_data: dict, export_root: Path) -> dict[str, str]:
    import torch

    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.config import config_from_dict
    from scse_dist.data.tokenizer import train_tokenizer
    from scse_dist.model import LoopedLM

    (d / "empty.txt").write_text("")
    (d / "empty.jsonl").write_text("")
    (d / "binary.txt").write_bytes(b"fine first line\nbad \x98 byte\n")
    (d / "bad.jsonl").write_text('{"text": "a good passage"}\n{"text": \n')
    (d / "nofield.jsonl").write_text('{"body": "a passage without text"}\n')
    (d / "good.jsonl").write_text('{"text": "the cat sees the red ball today"}\n')
    (d / "bad.yaml").write_text("model:\n  d_model: [}\n")
    (d / "typo.yaml").write_text("train:\n  max_step: 3\n")
    config = tiny_config_dict(tiny_data, str(d / "runs"))
    (d / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # A real sentencepiece model, just not the one the shards were written with.
    other = str(d / "other.model")
    train_tokenizer(tiny_documents(80, seed=1), 300, other)
    # A tiny export whose config reads the session's shards and tokenizer.
    torch.manual_seed(0)
    cfg = config_from_dict(config)
    export = save_exported_model(LoopedLM(cfg.model).state_dict(), cfg, str(export_root / "export"))
    broken = shutil.copytree(export, export_root / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    (d / "run-noeval").mkdir()
    for run, text in [("empty", b""), ("binary", b'{"task": "\x98"}'), ("bad", b'{"task": '),
                      ("nodepth", b'{"task": "heldout", "results": [{"ppl": 3.0}]}')]:
        (d / f"run-{run}" / "eval").mkdir(parents=True)
        (d / f"run-{run}" / "eval" / "heldout.json").write_bytes(text)
    return {"d": str(d), "export": export, "shards": tiny_data["path"],
            "tok": tiny_data["tokenizer"], "other": other, "config": str(d / "tiny.yaml"),
            "broken": str(broken)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_data, subprocess_env):
    d = tmp_path_factory.mktemp("bad_input")
    paths = _write_inputs(d, tiny_data, tmp_path_factory.mktemp("bad_input_export"))

    def run(key):
        command, i = key
        args, _, _ = CASES[command][i]
        argv = args.format(**paths).split()
        if command == "eval":
            argv = ["--checkpoint", paths["export"], "--out", f"{d}/r{i}.json", *argv]
        return run_profiling_imports(_command(command) + argv, subprocess_env, cwd=d, timeout=300)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(IDS, pool.map(run, IDS)))
    yield done, paths
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("key", IDS, ids=[f"{c.replace('/', '_')}-{i}" for c, i in IDS])
def test_bad_input_is_one_line_naming_the_file(results, key):
    done, paths = results
    command, i = key
    args, status, names = CASES[command][i]
    proc = done[key]
    err = proc.stderr
    context = (f"{command} {args}: rc {proc.returncode}\nstderr: {err}\n"
               f"stdout tail: {proc.stdout[-500:]}"
               f"\nimported torch/deepspeed: {sorted(proc.imported & {'torch', 'deepspeed'})}")
    assert "Traceback" not in err, context
    assert err.endswith("\n") and err.count("\n") == 1, context
    prog = SCRIPTS.get(command, "scse-train")
    kind = "config error" if status == BAD_CONFIG else "error"
    assert err.startswith(f"{prog}: {kind}: "), context
    assert names.format(**paths) in err, context
    assert proc.returncode == status, context
    # Rejecting bad input needs neither torch nor DeepSpeed (seconds of imports), unless the bad
    # input is the weights themselves.
    heavy = sorted(proc.imported & {"torch", "deepspeed"})
    assert heavy == (["torch"] if args in LOADS_WEIGHTS else []), context


def test_only_bad_input_becomes_a_line_a_bug_still_raises(capsys):
    import io
    import json

    from scse_dist.cli_errors import InputError, cli_main
    from scse_dist.typed_yaml import ConfigError

    def command(exc):
        @cli_main("scse-x")
        def main(argv=None):
            raise exc
        return main

    for exc, status, line in [
            (ConfigError("train.optimizer.lr: must be > 0\n  got 0"), BAD_CONFIG,
             "scse-x: config error: train.optimizer.lr: must be > 0 got 0\n"),
            (InputError("a.jsonl:3: not valid JSON"), BAD_INPUT,
             "scse-x: error: a.jsonl:3: not valid JSON\n"),
            (FileNotFoundError(2, "No such file or directory", "b.txt"), NO_INPUT,
             "scse-x: error: [Errno 2] No such file or directory: 'b.txt'\n"),
            (json.JSONDecodeError("Expecting value", "{", 1), BAD_INPUT,
             "scse-x: error: Expecting value: line 1 column 2 (char 1)\n")]:
        assert command(exc)() == status
        assert capsys.readouterr().err == line
    for bug in (KeyError("depth"), TypeError("unsupported operand"),
                ValueError("math domain error"),
                io.UnsupportedOperation("readline")):
        with pytest.raises(type(bug)):
            command(bug)()
        assert capsys.readouterr().err == ""
