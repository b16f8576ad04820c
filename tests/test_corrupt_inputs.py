"""Corrupt files at every command that reads them: a documented exit status, one line naming the
file, never a traceback, and every file around it left as it was.

One table, PROBES: each row corrupts one file of a tiny experiment directory (shards, their
tokenizer, a trained run with its checkpoint and export, a run config, a study spec) at offsets
drawn from a seeded generator, runs one command there as a user would (cwd = the experiment dir,
outside the checkout), and checks its exit status and its line, and that the listing of the
directory (every path with its sha256) is the same before and after. The experiment dir is built
once per module (one 2-step training run); each probe works on its own copy. Docs:
docs/config.md, "Bad input and exit statuses".
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import yaml

from conftest import console_script, tiny_config_dict, tiny_documents

pytestmark = pytest.mark.slow

BAD_CONFIG, BAD_INPUT, NO_INPUT = 2, 65, 66  # scse_dist.cli_errors
FOUND_BAD = 1  # `scse-data inspect`'s verdict on shards that do not read back, its report on stdout
SEED = 38
BYTES = 8  # corrupted per file
RUN = "runs/tiny"
TAG = f"{RUN}/checkpoints/step-0000002"
EXPORT = f"{RUN}/export"

# the commands, run in the experiment dir (its config and spec use paths relative to it)
TRAIN_NEW = "scse-train --config tiny.yaml name=fresh"  # reads the shards from the start
TRAIN_RESUME = "scse-train --config tiny.yaml train.max_steps=3"  # resumes runs/tiny
EVAL = f"scse-eval --checkpoint {EXPORT} --task heldout --data shards --out eval.json"
INSPECT = "scse-data inspect shards"
SHARDS = "scse-data shards --input docs.jsonl --tokenizer tokenizer.model --out new-shards"
EXPORT_CMD = f"scse-export {RUN} --out new-export"
GENERATE = f"scse-generate {EXPORT} --prompt the --max-new-tokens 4"
STUDY = "scse-study spec.yaml --dry-run"


class Probe(NamedTuple):
    target: str  # the file corrupted, relative to the experiment dir
    command: str
    status: int
    names: str  # text the one line on stderr must contain


PROBES = {
    "shard-train": Probe("shards/train-000000.tar", TRAIN_NEW, BAD_INPUT, "train-000000"),
    "shard-inspect": Probe("shards/train-000000.tar", INSPECT, FOUND_BAD,
                           "BAD train-000000.tar: shards/train-000000.tar: sample"),
    "heldout-eval": Probe("shards/heldout-000000.tar", EVAL, BAD_INPUT, "heldout-000000"),
    "table-train": Probe("shards/train-000000.samples.npy", TRAIN_NEW, BAD_INPUT,
                         "train-000000.samples.npy"),
    "table-inspect": Probe("shards/train-000000.samples.npy", INSPECT, FOUND_BAD,
                           "BAD train-000000.tar: shards/train-000000.samples.npy"),
    "index-train": Probe("shards/index.json", TRAIN_NEW, BAD_INPUT, "shards/index.json"),
    "index-eval": Probe("shards/index.json", EVAL, BAD_INPUT, "shards/index.json"),
    "index-inspect": Probe("shards/index.json", INSPECT, BAD_INPUT, "shards/index.json"),
    "tokenizer-train": Probe("tokenizer.model", TRAIN_NEW, BAD_INPUT, "tokenizer.model"),
    "tokenizer-shards": Probe("tokenizer.model", SHARDS, BAD_INPUT, "tokenizer.model"),
    "tokenizer-export": Probe("tokenizer.model", EXPORT_CMD, BAD_INPUT, "tokenizer.model"),
    "export-tokenizer-eval": Probe(f"{EXPORT}/tokenizer.model", EVAL, BAD_INPUT, "tokenizer"),
    "export-tokenizer-generate": Probe(f"{EXPORT}/tokenizer.model", GENERATE, BAD_INPUT,
                                       "tokenizer.model"),
    "checkpoint-train": Probe(f"{TAG}/mp_rank_00_model_states.pt", TRAIN_RESUME, BAD_INPUT,
                              "step-0000002"),
    "checkpoint-export": Probe(f"{TAG}/mp_rank_00_model_states.pt", EXPORT_CMD, BAD_INPUT,
                               "step-0000002"),
    "checkpoint-eval": Probe(f"{TAG}/mp_rank_00_model_states.pt", EVAL.replace(EXPORT, RUN),
                             BAD_INPUT, "step-0000002"),
    "checkpoint-generate": Probe(f"{TAG}/mp_rank_00_model_states.pt", f"scse-generate {RUN} "
                                 "--prompt the --max-new-tokens 4", BAD_INPUT, "step-0000002"),
    "tag-config-train": Probe(f"{TAG}/config.json", TRAIN_RESUME, BAD_INPUT, "step-0000002"),
    # read as the config it is before the weights, as an export's config.yaml is
    "tag-config-export": Probe(f"{TAG}/config.json", EXPORT_CMD, BAD_CONFIG, "config.json"),
    "weights-eval": Probe(f"{EXPORT}/model.safetensors", EVAL, BAD_INPUT, "model.safetensors"),
    "weights-generate": Probe(f"{EXPORT}/model.safetensors", GENERATE, BAD_INPUT,
                              "model.safetensors"),
    "weights-init-from": Probe(f"{EXPORT}/model.safetensors",
                               f"{TRAIN_NEW} train.start.init_from={EXPORT}", BAD_INPUT,
                               "model.safetensors"),
    "export-config-eval": Probe(f"{EXPORT}/config.yaml", EVAL, BAD_CONFIG, "config.yaml"),
    "export-config-generate": Probe(f"{EXPORT}/config.yaml", GENERATE, BAD_CONFIG,
                                    "config.yaml"),
    "config-train": Probe("tiny.yaml", TRAIN_NEW, BAD_CONFIG, "tiny.yaml"),
    "config-study": Probe("tiny.yaml", STUDY, BAD_CONFIG, "tiny.yaml"),
    "spec-study": Probe("spec.yaml", STUDY, BAD_CONFIG, "spec.yaml"),
}


def corrupt_offsets(path: Path, rng: random.Random) -> list[int]:
    """Where to corrupt `path`: the bytes a reader decodes. In a shard, BYTES in the first 512
    bytes of every sample's token data (its sample table gives the places; a short run reads the
    start of some sample); in a safetensors file, its header (its tensor data carry no checksum:
    a changed weight is another model, not an error anyone can see); anywhere in other files."""
    data = path.read_bytes()
    if path.suffix == ".tar":
        table = np.load(path.with_name(path.name[:-len(".tar")] + ".samples.npy"))
        offsets = []
        for npy, size in table[:, 2:4].tolist():  # tokens.npy: magic, version, header length
            start = npy + 10 + int.from_bytes(data[npy + 8:npy + 10], "little")
            offsets += rng.sample(range(start, start + min(512, size - (start - npy))), BYTES)
        return sorted(offsets)
    if path.suffix == ".safetensors":
        start, length = 0, 8 + int.from_bytes(data[:8], "little")
    else:
        start, length = 0, len(data)
    return sorted(rng.sample(range(start, start + length), min(BYTES, length)))


def corrupt(path: Path, seed: str) -> None:
    """Flip the top bit and some others of the bytes at seeded offsets: in text, each becomes a
    byte that is not UTF-8; in binary data, a value off by at least 128."""
    rng = random.Random(seed)
    data = bytearray(path.read_bytes())
    for offset in corrupt_offsets(path, rng):
        data[offset] ^= 0x80 | rng.randrange(128)
    path.write_bytes(bytes(data))


def listing(root: Path) -> dict[str, str]:
    """Every file and folder under root: its sha256, or 'dir'."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_data, subprocess_env) -> Path:
    """A user's experiment dir: shards and tokenizer, tiny.yaml, a 2-step run of it with its
    checkpoint and export, a study spec over it, and a JSONL corpus."""
    root = tmp_path_factory.mktemp("experiment")
    shutil.copytree(tiny_data["path"], root / "shards")
    shutil.copy(tiny_data["tokenizer"], root / "tokenizer.model")
    config = tiny_config_dict({"path": "shards", "tokenizer": "tokenizer.model"}, "runs")
    config["train"].update(max_steps=2, checkpoint={"every": 2})
    (root / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (root / "spec.yaml").write_text(yaml.safe_dump(
        {"name": "s", "out": "studies", "base": "tiny.yaml",
         "variants": {"scse": {"overrides": {}}}, "seeds": [0]}, sort_keys=False))
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                             for t in tiny_documents(20, seed=3)))
    # data paths on the command line stay relative in the run's saved config, so each probe's
    # copy of the experiment reads its own files (a config file's would be absolute: the original)
    train = ["--config", "tiny.yaml", "data.path=shards", "data.tokenizer=tokenizer.model"]
    out = subprocess.run(console_script("scse-train") + train, cwd=root, env=subprocess_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return root


@pytest.mark.parametrize("name", list(PROBES))
def test_a_corrupt_file_is_one_line_a_documented_status_and_changes_nothing(
        name, experiment, tmp_path, subprocess_env):
    probe = PROBES[name]
    d = tmp_path / "exp"
    shutil.copytree(experiment, d)
    corrupt(d / probe.target, f"{SEED}:{probe.target}")
    before = listing(d)
    prog, *args = probe.command.split()
    out = subprocess.run(console_script(prog) + args, cwd=d, env=subprocess_env,
                         capture_output=True, text=True, timeout=300)
    context = f"{probe.command}: rc {out.returncode}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, context
    assert out.returncode == probe.status, context
    if probe.status == FOUND_BAD:  # a report on stdout, a BAD line per shard
        assert out.stderr == "" and f"    {probe.names}" in out.stdout, out.stdout
    else:  # one line, after a line per skipped sample (scse-train skips bad ones up to a limit)
        lines = [line for line in out.stderr.splitlines() if not line.startswith("skipping ")]
        assert len(lines) == 1 and out.stderr.splitlines()[-1] == lines[0], context
        assert lines[0].startswith(f"{prog}: ") and probe.names in out.stderr, context
    after = listing(d)
    assert {p: after.get(p) for p in before} == before, context  # nothing changed or removed
    assert sorted(after.keys() - before.keys()) == [], context  # nothing new
