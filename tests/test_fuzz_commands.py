"""Command fuzzing: every console script under generated argument vectors and mutated input files
(tests/fuzz_corpus.py), checked per example for three properties: no traceback, an exit status
in the command's documented set (docs/config.md, docs/checkpoints.md), and no file changed or
removed, and none added outside the command's own output (out/, where --out points).

Seeded (derandomize) and repeatable. Most examples run a command's `main(argv)` in this process
(seconds of imports saved each), its cwd, environment and sys.argv restored after; a few per
command spawn the real console script. Nothing trains for long: in this process scse-train runs
only with --dry-run, --plan or --print-config, and scse-launch and scse-study never run a job
here; the spawned scse-train runs are 2 steps of the tiny model.

Budget: `--fuzz-examples N` per command in this process (default 60), and N // 20 spawned; the
failures found are kept in REGRESSIONS.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import console_script
from fuzz_corpus import (
    BINARY_FILES,
    TAG,
    YAML_FILES,
    Outcome,
    build_seed_corpus,
    changed,
    file_mutations,
    mutate,
    run_in_process,
    snapshot,
)

pytestmark = pytest.mark.slow
TRACEBACK = "Traceback (most recent call last)"
BAD = {2, 65, 66, 74, 130}  # every command (cli_errors.py; 74 a full disk)
GOOD_PATHS = ["tok.model", "shards", "tiny.yaml", "spec.yaml", "run", "run/export", TAG,
              "run/checkpoints", "good.jsonl", "prompts.txt", "run/export/model.safetensors", "."]
NEW_PATHS = ["missing", "missing.yaml", "out/new", "out/new.json", "out/new.model", "out", ""]
NUMBERS = ["-1", "0", "1", "2", "3", "64", "0.5", "-0.5", "1e309", "nan", "inf", "0x10", "1_0"]
HUGE = ["10000000000", "1e12", "9" * 30]  # only for flags a tiny run does not loop or allocate by
GARBAGE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                  max_size=8)
CONFIG_KEYS = ["train.max_steps", "model.d_model", "model.depth", "data.path", "data.tokenizer",
               "data.seq_len", "train.batch.micro_batch_size", "train.engine.deepspeed_config",
               "train.depth.max", "train.start.resume", "train.start.init_from", "eval.depths",
               "model.vocab_size", "output_dir", "name", "train.maxsteps", "nope", "model",
               "data.build", "train.checkpoint.every", "eval.tasks", "model.recurrence"]
SPEC_KEYS = ["name", "out", "base", "seeds", "variants", "axes", "lr", "evals", "order",
             "overrides", "nope", "evals.tasks", "variants.scse.overrides"]


@dataclass
class Command:
    """A console script: its argument templates, the flags and files its fuzzing varies, and the
    exit statuses its docs allow."""
    name: str
    entry: str  # module:function
    templates: list[list[str]]
    files: list[str]
    statuses: set[int]
    flags: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key=value overrides
    huge: tuple[str, ...] = ()  # flags that take a huge number without harm
    writes: tuple[str, ...] = ()  # its default outputs, beside out/ and --out
    checks: tuple[str, ...] = ()  # subcommands documented to exit 1 when they find a fault
    logs: bool = False  # a submission's job files in RUN/logs/ (the run an override may move)
    # argv -> whether it may run in this process (it must not train); None: any
    in_process: Optional[Callable[[list[str]], bool]] = None

    def main(self) -> Callable:
        module, func = self.entry.split(":")
        return getattr(importlib.import_module(module), func)


def _parsed(parser_of: str, argv: list[str],
            intermixed: bool = False) -> Optional[argparse.Namespace]:
    """argv as the command's parser reads it, or None where the parser refuses it (exit 2)."""
    module, func = parser_of.split(":")
    parser = getattr(importlib.import_module(module), func)()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return (parser.parse_intermixed_args if intermixed else parser.parse_args)(argv)
        except SystemExit:
            return None


def _train_does_not_train(argv: list[str]) -> bool:
    args = _parsed("scse_dist.train.cli:build_parser", argv)
    return args is None or args.dry_run or args.plan or args.print_config


def _launch_does_not_train(argv: list[str]) -> bool:
    args = _parsed("scse_dist.launch.scheduler:build_parser", argv)
    return args is None or not (args.local or args.backend == "local")


def _study_does_not_run(argv: list[str]) -> bool:
    args = _parsed("scse_dist.study.cli:build_parser", argv, intermixed=True)
    return args is None or args.dry_run or (args.backend != "local" and not args.local)


def _lm_eval_refuses(argv: list[str]) -> bool:
    from scse_dist.lmeval.cli import hoist_model_args, refused_tasks

    args = hoist_model_args(argv)
    return bool(args) and args[0] not in ("ls", "validate") and refused_tasks(args) is not None


def _flags(parser_of: str) -> list[str]:
    """Every option string of a parser and its subcommands' parsers."""
    module, func = parser_of.split(":")
    parsers, found = [getattr(importlib.import_module(module), func)()], []
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            found += action.option_strings
            if isinstance(action, argparse._SubParsersAction):
                parsers += list(action.choices.values())
    return sorted(set(found))


EXPORT = "run/export"
COMMANDS = {c.name: c for c in [
    Command("scse-train", "scse_dist.train.cli:main",
            [["--config", "tiny.yaml", "--dry-run"], ["--config", "tiny.yaml", "--plan",
                                                      "--world-size", "8"],
             ["--config", "tiny.yaml", "--print-config"], ["--config", "run/config.yaml",
                                                           "--dry-run"]],
            YAML_FILES[:1] + ["run/config.yaml", "shards/index.json"] + BINARY_FILES[:4],
            BAD | {0, 3, 4, 75}, _flags("scse_dist.train.cli:build_parser"), CONFIG_KEYS,
            ("--world-size", "--tokens", "--link-gbs", "--mfu", "--gpus-per-node"),
            in_process=_train_does_not_train),
    Command("scse-data", "scse_dist.data.cli:main",
            [["inspect", "shards"],
             ["shards", "--input", "good.jsonl", "--tokenizer", "tok.model", "--out", "out/s"],
             ["tokenizer", "--input", "good.jsonl", "--vocab-size", "40", "--out", "out/t.model"],
             ["shards", "--input", "good.jsonl", "--tokenizer", "tok.model", "--out", "out/p",
              "--part", "1/2"], ["merge", "shards"]],
            ["shards/index.json"] + BINARY_FILES[:5] + ["good.jsonl"], BAD | {0},
            [f for f in _flags("scse_dist.data.cli:build_parser") if f not in ("--processes",
                                                                                "--workers")],
            huge=("--vocab-size", "--max-bad-rows", "--shard-mb", "--sample-tokens",
                  "--max-sentences", "--progress-every"), checks=("inspect",),
            in_process=lambda argv: "quickstart" not in argv),  # builds a 4096-token corpus
    Command("scse-eval", "scse_dist.eval.cli:main",
            [["--checkpoint", EXPORT, "--task", "heldout", "--out", "out/r.json",
              "--max-batches", "1", "--depths", "1,2"],
             ["--checkpoint", EXPORT, "--task", "lambada", "--data", "good.jsonl", "--out",
              "out/r.json", "--depths", "2"],
             ["--checkpoint", "run", "--task", "heldout", "--data", "shards", "--out",
              "out/r.json", "--max-batches", "1", "--depths", "1"]],
            ["run/export/config.yaml", "run/export/model.safetensors", "run/export/tokenizer.model",
             "shards/index.json", "shards/heldout-000000.tar", "good.jsonl", "run/config.yaml"],
            BAD | {0}, _flags("scse_dist.eval.cli:build_parser"), huge=("--batch-size",)),
    Command("scse-report", "scse_dist.study.report_cli:main",
            [["run", "--out", "out/rep"], ["--study", "out/studies/s"], ["run", "run"]],
            ["run/eval/heldout.json", "run/config.yaml"], BAD | {0},
            ["--study", "--out", "--wandb", "-h"], writes=("report/",)),
    Command("scse-launch", "scse_dist.launch.scheduler:main",
            [["tiny.yaml"], ["tiny.yaml", "--evaluate"], ["tiny.yaml", "--after-job", "12"],
             ["run/config.yaml", "--evaluate"]],
            ["tiny.yaml", "run/config.yaml", "shards/index.json"], BAD | {0, 1, 75},
            _flags("scse_dist.launch.scheduler:build_parser"), CONFIG_KEYS,
            in_process=_launch_does_not_train, logs=True),
    Command("scse-study", "scse_dist.study.cli:main",
            [["spec.yaml", "--dry-run"], ["spec.yaml", "--dry-run", "--stage", "sweep"]],
            ["spec.yaml", "tiny.yaml", "shards/index.json", "tok.model"], BAD | {0, 1, 75},
            _flags("scse_dist.study.cli:build_parser"), SPEC_KEYS, ("--max-parallel",),
            in_process=_study_does_not_run),
    Command("scse-ckpt", "scse_dist.checkpoint.cli:main",
            [["list", "run"], ["verify", "run"], ["verify", "run/checkpoints"]],
            [f"{TAG}/manifest.json", f"{TAG}/scse_meta.json", f"{TAG}/config.json",
             f"{TAG}/mp_rank_00_model_states.pt", "run/checkpoints/latest"], BAD | {0},
            _flags("scse_dist.checkpoint.cli:build_parser"), checks=("list", "verify")),
    Command("scse-export", "scse_dist.checkpoint.export_cli:main",
            [["run", "--out", "out/x"], [TAG, "--out", "out/x", "--tokenizer", "tok.model"]],
            [f"{TAG}/manifest.json", f"{TAG}/scse_meta.json", f"{TAG}/config.json",
             f"{TAG}/mp_rank_00_model_states.pt", "run/checkpoints/latest", "tok.model",
             "run/config.yaml"], BAD | {0, 75},
            _flags("scse_dist.checkpoint.export_cli:build_parser")),
    Command("scse-generate", "scse_dist.generate.cli:main",
            [[EXPORT, "--prompt", "the cat", "--max-new-tokens", "4"],
             [EXPORT, "--prompt-file", "prompts.txt", "--max-new-tokens", "3", "--depth", "2"],
             [EXPORT, "--prompt", "a dog", "--max-new-tokens", "3", "--exit", "motion:0.02"]],
            ["run/export/config.yaml", "run/export/model.safetensors",
             "run/export/tokenizer.model", "prompts.txt"], BAD | {0},
            ["--prompt", "--prompt-file", "--depth", "--exit", "--speculative", "--max-new-tokens",
             "--temperature", "--top-p", "--seed", "--cache", "--device"]),
    # the seed export is a looped SCSE model: to-hf and retrofit refuse it (65) unless a
    # mutation breaks it first; from-hf reads no Hugging Face folder here (HF_HUB_OFFLINE below)
    Command("scse-convert", "scse_dist.convert.cli:main",
            [["to-hf", EXPORT, "--out", "out/hf"],
             ["retrofit", EXPORT, "--out", "out/r", "--recurrence", "scse", "--prelude", "0",
              "--core", "1", "--coda", "2"],
             ["from-hf", EXPORT, "--out", "out/x"]],
            ["run/export/config.yaml", "run/export/model.safetensors",
             "run/export/tokenizer.model"], BAD | {0},
            _flags("scse_dist.convert.cli:build_parser")),
    # lm-eval is an optional extra: without it the command says so and exits 1. In this process
    # only what is refused before lm-eval's own CLI starts (it indexes ~15k tasks: 45 s)
    Command("scse-lm-eval", "scse_dist.lmeval.cli:main",
            [["--model", "scse", "--model_args", f"pretrained={EXPORT},batch_size=2", "--tasks",
              "scse_lambda", "--limit", "2"], ["--tasks", "scse_wikitext,nope", "-t", ","]],
            [], BAD | {0, 1}, ["--model", "--model_args", "-a", "--tasks", "-t", "--limit",
                               "--include_path", "--batch_size", "--device"],
            in_process=_lm_eval_refuses),
]}
assert not {c.name for c in COMMANDS.values()} ^ {
    name for name in __import__("tomllib").loads((Path(__file__).parents[1] / "pyproject.toml")
                                                 .read_text())["project"]["scripts"]}


def values(command: Command, flag: Optional[str]) -> st.SearchStrategy[str]:
    numbers = NUMBERS + (HUGE if flag in command.huge else [])
    return (st.sampled_from(GOOD_PATHS + NEW_PATHS) | st.sampled_from(numbers) | GARBAGE |
            st.sampled_from(["heldout", "lambada", "1,2", "--", "-h", "scse", "h100", "cuda"]))


@st.composite
def argvs(draw, command: Command) -> list[str]:
    """A template with up to 3 edits: a token dropped, replaced, a flag (with a value) or an
    override inserted."""
    argv = list(draw(st.sampled_from(command.templates)))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(argv)))
        edit = draw(st.sampled_from(["drop", "replace", "flag", "override"]))
        if edit == "drop" and argv:
            del argv[min(at, len(argv) - 1)]
        elif edit == "replace" and argv:
            at = min(at, len(argv) - 1)
            argv[at] = draw(values(command, argv[at - 1] if at else None))
        elif edit == "flag" and command.flags:
            flag = draw(st.sampled_from(command.flags))
            argv[at:at] = [flag] + draw(st.lists(values(command, flag), max_size=1))
        elif edit == "override" and command.keys:
            key = draw(st.sampled_from(command.keys) | GARBAGE)
            argv[at:at] = [f"{key}={draw(values(command, None))}"]
    return argv


def run_spawned(command: Command, argv: list[str], cwd: Path, env: dict) -> Outcome:
    env = {**env, "HF_HUB_OFFLINE": "1"}  # scse-convert from-hf: a hub id, never a download
    done = subprocess.run(console_script(command.name) + argv, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    return Outcome(done.returncode, done.stdout, done.stderr)


def check(command: Command, seed: Path, scratch: Path, argv: list[str], mutations: list,
          env: Optional[dict] = None) -> Outcome:
    """Run one example in a fresh copy of the seed corpus and assert the three properties."""
    work = scratch / "ex"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(seed, work, symlinks=True)
    for mutation in mutations:
        mutate(work, mutation)
    before = snapshot(work)
    if env is None:
        outcome = run_in_process(command.main(), argv, work)
    else:
        outcome = run_spawned(command, argv, work, env)
    what = f"{command.name} {argv} with {mutations}: exit {outcome.status}\n{outcome.stderr}"
    assert TRACEBACK not in outcome.stderr, what
    checks = {1} if set(command.checks) & set(argv) else set()
    assert outcome.status in command.statuses | checks, what
    # new files where --out points are the command's output; no existing file may change
    out = [os.path.normpath(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--out"]
    harmed = [p for p in changed(before, snapshot(work)) if p in before or not (
        p.startswith(command.writes) or any(o in (".", p) or p.startswith(o + "/") for o in out)
        or command.logs and outcome.status == 0 and "/logs/" in p)]
    assert not harmed, (harmed, what)
    TALLY.setdefault(command.name, {}).setdefault(outcome.status, 0)
    TALLY[command.name][outcome.status] += 1
    return outcome


TALLY: dict[str, dict] = {}  # command -> {exit status: examples}, shown at the end


@pytest.fixture(scope="module", autouse=True)
def show_tally(request):
    yield
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        for name, statuses in TALLY.items():
            print(f"\nfuzz {name}: {sum(statuses.values())} examples run, exit statuses "
                  f"{dict(sorted(statuses.items(), key=str))}")


@pytest.fixture(scope="session")
def fuzz_seed(tmp_path_factory, tiny_data, subprocess_env) -> Path:
    return build_seed_corpus(tmp_path_factory.mktemp("fuzz"), tiny_data, subprocess_env)


@pytest.fixture
def fuzz_env(monkeypatch):
    """What an in-process command sees of the environment: no wandb, no launcher variables."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # scse-convert from-hf: a hub id, never a download
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    # scse-lm-eval lists lm-eval's ~15k task files for each call (1 s): once is enough here
    from scse_dist.lmeval import cli

    listed = functools.lru_cache(lambda dirs, names=cli.task_names: names(list(dirs)))
    monkeypatch.setattr(cli, "task_names", lambda dirs: listed(tuple(dirs)))


def examples(command: Command, seed: Path) -> st.SearchStrategy:
    mutations = (st.lists(file_mutations(seed, command.files), max_size=2) if command.files
                 else st.just([]))
    return st.tuples(argvs(command), mutations)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_fuzzed_command_in_process(name, fuzz_seed, fuzz_env, fuzz_examples, tmp_path):
    command = COMMANDS[name]

    @settings(max_examples=fuzz_examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(examples(command, fuzz_seed))
    def fuzz(example):
        argv, mutations = example
        assume(command.in_process is None or command.in_process(argv))
        check(command, fuzz_seed, tmp_path, argv, mutations)

    fuzz()


def spawned_examples(command: Command, seed: Path) -> st.SearchStrategy:
    """scse-train: real 2-step runs of the tiny config on mutated data; the others: as in
    process."""
    if command.name != "scse-train":
        return examples(command, seed)
    data_files = [f for f in command.files if f not in YAML_FILES]
    return st.tuples(st.just(["--config", "tiny.yaml", "train.max_steps=2"]),
                     st.lists(file_mutations(seed, data_files), max_size=2))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_fuzzed_command_as_a_process(name, fuzz_seed, fuzz_examples, subprocess_env, tmp_path):
    command = COMMANDS[name]

    @settings(max_examples=max(1, fuzz_examples // 20), derandomize=True, database=None,
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(spawned_examples(command, fuzz_seed))
    def fuzz(example):
        argv, mutations = example
        assume(name == "scse-train" or command.in_process is None or command.in_process(argv))
        check(command, fuzz_seed, tmp_path, argv, mutations, subprocess_env)

    fuzz()


# Failures the fuzzer found, minimised, each fixed in the package: (command, argv, mutations).
REGRESSIONS = [
    ("scse-ckpt", ["list", "run"],
     [("json_del", f"{TAG}/manifest.json", ["files", "config.json", "size"])]),
    ("scse-ckpt", ["list", "run"], [("json_set", f"{TAG}/manifest.json", ["files"], None)]),
    ("scse-data", ["inspect", "shards"],
     [("json_set", "shards/index.json", ["splits", "heldout", 0, "tokens"], None)]),
    ("scse-study", ["spec.yaml", "--dry-run"], [("yaml_set", "spec.yaml", ["out"], None)]),
    ("scse-study", ["spec.yaml", "--dry-run"],
     [("yaml_set", "spec.yaml", ["evals", "tasks", 0], {"k": 1})]),
    ("scse-study", ["spec.yaml", "--dry-run"],
     [("yaml_set", "spec.yaml", ["pairs"], [[{"k": 1}, "scse"]])]),
    ("scse-generate", [EXPORT, "--prompt", "tok.model", "--device", "4"], []),
    ("scse-generate", [EXPORT, "--prompt", "a", "--device", "cuda"], []),
    ("scse-eval", ["--checkpoint", EXPORT, "--task", "heldout", "--out", "out/r.json",
                   "--max-batches", "1", "--depths", "1", "--device", "cuda:x"], []),
]


@pytest.mark.parametrize("name, argv, mutations", REGRESSIONS)
def test_a_failure_once_found(name, argv, mutations, fuzz_seed, fuzz_env, tmp_path):
    check(COMMANDS[name], fuzz_seed, tmp_path, argv, mutations)
