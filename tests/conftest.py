"""Shared fixtures: a tiny tokenizer + shard corpus (built once per session) and tiny run configs.

    def test_x(tiny_data, tiny_config):
        path = tiny_config(tmp_path, "train.max_steps=5")   # YAML file for --config / load_config
        cfg = load_config(path)

The corpus is synthetic, learnable text (a small grammar), so a few dozen steps visibly cut the
loss.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]

# The first lines of a child script that must run without scse_dist (an export's remote code, a
# copied model file): any import of it fails, as on a machine where it is not installed.
WITHOUT_SCSE_DIST = """import importlib.abc
import sys
class NoScseDist(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "scse_dist":
            raise ImportError("scse_dist is not importable here: " + name)
sys.meta_path.insert(0, NoScseDist())
"""

TINY_VOCAB = 320

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird",
             "our teacher"]
_VERBS = ["sees", "likes", "finds", "paints", "follows", "builds", "reads"]
_OBJECTS = ["the red ball", "a green box", "the tall tree", "an open door", "the blue river",
            "a quiet house", "the bright moon"]
_ENDINGS = ["today.", "at night.", "in the park.", "again and again.", "with great care."]


def tiny_documents(n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                     f"{rng.choice(_ENDINGS)}" for _ in range(rng.randint(3, 8))]
        docs.append(f"Story {i}. " + " ".join(s.capitalize() for s in sentences))
    return docs


class Profiled(NamedTuple):
    """A finished process run with PYTHONPROFILEIMPORTTIME=1: its own stderr, and the top-level
    packages it imported (what a command pays for before it answers)."""
    returncode: int
    stdout: str
    stderr: str
    imported: frozenset[str]


def sigint_default() -> None:
    """Popen's preexec_fn for a child a test interrupts with SIGINT: a runner started in the
    background (`nohup pytest &`, a CI step) has SIGINT ignored, the child inherits that, and
    Python then installs no KeyboardInterrupt handler: the signal would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def console_script(name: str) -> list[str]:
    """The command line of console script `name` (pyproject.toml [project.scripts]): the venv's own
    script when it runs this checkout's entry point, else that entry point run by this interpreter
    (an editable install made before an entry point moved keeps the old script)."""
    import tomllib

    entry = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"][name]
    module, func = entry.split(":")
    script = Path(sys.executable).parent / name
    if script.is_file() and f"from {module} import {func}" in script.read_text():
        return [str(script)]
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def run_profiling_imports(cmd: list[str], env: dict[str, str], **kwargs) -> Profiled:
    """subprocess.run(cmd) with Python's import profile on stderr, split off from the command's
    own lines (each profile line starts with 'import time:')."""
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(env, PYTHONPROFILEIMPORTTIME="1"), **kwargs)
    profile = [line for line in proc.stderr.splitlines(True) if line.startswith("import time:")]
    own = "".join(line for line in proc.stderr.splitlines(True)
                  if not line.startswith("import time:"))
    # "import time: self [us] | cumulative | imported package" -> the top-level package
    packages = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in profile[1:]}
    return Profiled(proc.returncode, proc.stdout, own, frozenset(packages))


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=60, metavar="N",
                     help="examples per command for tests/test_fuzz_commands.py (default 60)")


@pytest.fixture(scope="session")
def fuzz_examples(request) -> int:
    return request.config.getoption("--fuzz-examples")


@pytest.fixture(autouse=True)
def cpu_settings():
    """One thread: the test models are too small to gain from two, and busy-waiting OpenMP threads
    crawl when other processes share the 2 cores. Subnormals flushed: zero-start ablations produce
    them, which makes CPU math ~10x slower (same losses with flushing, measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, str]:
    """{'path': shard dir with train + heldout splits, 'tokenizer': sentencepiece model path}."""
    from scse_dist.data.shards import write_shards
    from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    docs = tiny_documents()
    tok_path = str(root / "tokenizer.model")
    train_tokenizer(docs, TINY_VOCAB, tok_path)
    shards = str(root / "shards")
    # Small samples so the train split holds several tar samples (more than any test's world size).
    write_shards(docs, Tokenizer.load(tok_path), shards, heldout_fraction=0.1, sample_tokens=2048)
    return {"path": shards, "tokenizer": tok_path}


def tiny_config_dict(data: dict[str, str], output_dir: str) -> dict:
    return {
        "name": "tiny",
        "output_dir": output_dir,
        "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2, "max_seq_len": 32,
                  "n_prelude": 1, "n_core": 1, "n_coda": 1, "recurrence": "scse", "depth": 2},
        "data": {"path": data["path"], "tokenizer": data["tokenizer"], "seq_len": 32},
        "train": {"batch": {"micro_batch_size": 4}, "max_steps": 20, "optimizer": {"lr": 3e-3},
                  "schedule": {"warmup_steps": 2}, "log_every": 5,
                  "checkpoint": {"every": 10, "keep": 2},
                  "depth": {"kind": "uniform", "min": 1, "max": 3}},
        "eval": {"depths": [1, 2], "batch_size": 4, "max_batches": 2, "after_train": False},
        "wandb": {"enabled": False},
    }


@pytest.fixture(scope="session")
def tiny_config(tiny_data) -> Callable[..., str]:
    """Factory: tiny_config(directory, 'a.b=c', ...) writes directory/tiny.yaml and returns its
    path.

    Runs go to directory/runs/tiny. Overrides use the CLI's `key.sub=value` syntax.
    """
    from scse_dist.typed_yaml import apply_overrides

    def make(directory: str | os.PathLike, *overrides: str) -> str:
        directory = Path(directory)
        values = apply_overrides(tiny_config_dict(tiny_data, str(directory / "runs")),
                                 list(overrides))
        path = directory / "tiny.yaml"
        path.write_text(yaml.safe_dump(values, sort_keys=False))
        return str(path)

    return make


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for launching the trainer in a child: no inherited launcher vars, CPU only."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONPATH=str(REPO_ROOT))
    return env


@pytest.fixture(scope="session")
def user_env(tmp_path_factory) -> dict[str, str]:
    """The environment a user runs commands in: no inherited launcher or wandb overrides, so each
    config's own wandb settings decide (WANDB_MODE would override them), and the venv's console
    scripts (scse-*, deepspeed, torchrun) on PATH. wandb's cache and config dirs (its debug logs,
    settings) point into a temp dir so tests write nothing into $HOME; runs still log to
    runs/<name>/wandb as configured. OMP_NUM_THREADS=1: tiny models, shared cores."""
    home = tmp_path_factory.mktemp("wandb_home")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "WANDB_MODE", "WANDB_DIR", "WANDB_DISABLED")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_DATA_DIR=str(home / "data"))
    return env


class S3Traffic:
    """WSGI middleware around moto's app: the GET requests it served, (path, body bytes) each,
    and the most GETs in flight at once; `delay` seconds added to each GET make overlap visible.

    Fault injection for PUTs: `refuse[substring] = n` answers the next n PUTs whose path holds
    `substring` with a 503; `put_delay` seconds slow every PUT down. After each PUT of a
    `checkpoints/latest`, `on_latest(path)` runs (e.g. to snapshot what the tag named holds)."""

    def __init__(self, app):
        self.app, self.gets, self.delay = app, [], 0.0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.refuse: dict[str, int] = {}
        self.refused: list[str] = []
        self.put_delay = 0.0
        self.on_latest = None

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] == "PUT":
            return self._put(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return self.app(environ, start_response)
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            chunks = list(self.app(environ, start_response))  # moto answers from memory
        finally:
            with self.lock:
                self.in_flight -= 1
        self.gets.append((environ["PATH_INFO"], sum(map(len, chunks))))
        return chunks

    def _put(self, environ, start_response):
        path = environ["PATH_INFO"]
        time.sleep(self.put_delay)
        with self.lock:
            hit = next((k for k, n in self.refuse.items() if k in path and n > 0), None)
            if hit is not None:
                self.refuse[hit] -= 1
                self.refused.append(path)
        if hit is not None:
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            return [b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"]
        chunks = list(self.app(environ, start_response))
        if path.endswith("/checkpoints/latest") and self.on_latest is not None:
            self.on_latest(path)
        return chunks


@pytest.fixture
def s3_traffic(monkeypatch):
    """A moto S3 server on 127.0.0.1 (a werkzeug thread, as moto's ThreadedMotoServer runs it),
    its traffic counted. In this process fsspec's config points s3fs at it; the same settings
    are in os.environ (FSSPEC_S3, AWS_*) for child processes."""
    import json

    import fsspec
    moto_server = pytest.importorskip("moto.server")
    from werkzeug.serving import make_server

    traffic = S3Traffic(moto_server.DomainDispatcherApplication(moto_server.create_backend_app))
    server = make_server("127.0.0.1", 0, traffic, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    s3_conf = {"endpoint_url": f"http://127.0.0.1:{server.server_port}", "key": "test",
               "secret": "test"}
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3": json.dumps(s3_conf)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {**s3_conf, "skip_instance_cache": True})
    yield traffic
    server.shutdown()
    thread.join()


@pytest.fixture
def s3_bucket(s3_traffic):
    """s3://scse-test on the s3_traffic server, emptied afterwards."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.mkdir("scse-test")
    yield "s3://scse-test"
    fs.rm("scse-test", recursive=True)  # moto's state is per process: the next test starts empty


def tiny_cfg(**model):
    """A validated RunConfig around a 64-token, d=32 model (model fields overridable); seeds
    torch."""
    import torch

    from scse_dist.config import config_from_dict

    tiny = {"vocab_size": 64, "d_model": 32, "n_heads": 2, "ffn_hidden": 64, "max_seq_len": 32,
            "depth": 2}
    cfg = config_from_dict({"name": "tiny", "model": {**tiny, **model}, "data": {"seq_len": 16}})
    torch.manual_seed(0)
    return cfg


class ModelOnlyEngine:
    """What the trainer's callbacks read of a DeepSpeed engine (its module, device and ZeRO
    stage), around a real model, with no DeepSpeed and no process group."""

    def __init__(self, module, zero_stage: int = 0):
        import torch

        self.module, self.device, self._stage = module, torch.device("cpu"), zero_stage

    def zero_optimization_stage(self) -> int:
        return self._stage


@pytest.fixture
def train_state(tiny_config, tiny_data, tmp_path):
    """Factory: train_state('a.b=c', ...) -> a TrainState of the tiny config (overrides applied)
    at step 0, as train() hands it to the callbacks: the real model (in a ModelOnlyEngine),
    training stream, tokenizer and rank-0 MetricsLogger (metrics.jsonl in state.run_dir), one
    rank. A callback test sets state.step and state.result and calls the hooks itself, with no
    training run."""
    from scse_dist.checkpoint.storage import RunStorage
    from scse_dist.config import load_config
    from scse_dist.data.stream import TokenStream
    from scse_dist.data.tokenizer import Tokenizer
    from scse_dist.distributed import DistEnv
    from scse_dist.model import LoopedLM
    from scse_dist.train.callbacks.base import TrainState
    from scse_dist.train.faults import FaultInjector
    from scse_dist.train.metrics import MetricsLogger

    loggers = []

    def make(*overrides: str) -> TrainState:
        cfg = load_config(tiny_config(tmp_path, *overrides))
        storage = RunStorage.for_config(cfg)
        storage.local.mkdir(parents=True, exist_ok=True)
        tokenizer = Tokenizer.load(cfg.data.tokenizer)
        stream = TokenStream.from_config(cfg.data, "train", cfg.train.batch.micro_batch_size, 0, 1,
                                         cfg.train.seed, tokenizer.sha256)
        logger = MetricsLogger(str(storage.local), True, cfg.wandb, cfg.name, {})
        loggers.append(logger)
        return TrainState(cfg=cfg, env=DistEnv(0, 1, 0, "127.0.0.1", 0, "none"),
                          run_dir=storage.local, storage=storage,
                          engine=ModelOnlyEngine(LoopedLM(cfg.model), cfg.train.engine.zero_stage),
                          stream=stream, tokenizer=tokenizer, logger=logger,
                          faults=FaultInjector(0, ""), start_step=0)

    yield make
    for logger in loggers:
        logger.close()


def step_result(loss: float = 2.0, skipped: bool = False, stop: bool = False, depth: int = 2):
    """A StepResult as train_step returns it (one micro-batch)."""
    import torch

    from scse_dist.train.step import StepResult

    return StepResult(torch.tensor(loss), 1, skipped, stop, depth)
