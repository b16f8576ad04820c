"""The command fuzzer's seed corpus, its mutators and its in-process runner
(tests/test_fuzz_commands.py).

The seed corpus is one folder, built once per session from conftest's tiny data plus a run of 2
steps (checkpoints, export, held-out results) and a study spec. Every example works in a fresh
copy of it; all paths are relative to that copy, which is the command's working directory:

    tok.model  shards/  tiny.yaml  spec.yaml  good.jsonl  prompts.txt
    run/  (checkpoints/step-0000001, step-0000002, latest; export/; eval/heldout.json)
    out/  the only place a command may write (tiny.yaml's output_dir, the spec's out, --out)

A file mutation is a plain tuple, so a failure hypothesis finds can be pasted as a regression
case: (kind, path, *params), applied by `mutate`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml
from hypothesis import strategies as st

TAG = "run/checkpoints/step-0000002"
YAML_FILES = ["tiny.yaml", "spec.yaml", "run/config.yaml", "run/export/config.yaml"]
JSON_FILES = ["shards/index.json", f"{TAG}/manifest.json", f"{TAG}/scse_meta.json",
              f"{TAG}/config.json", "run/eval/heldout.json", "run/export/config.json"]
BINARY_FILES = ["shards/train-000000.tar", "shards/heldout-000000.tar",
                "shards/heldout-000000.samples.npy", "tok.model", "run/export/tokenizer.model",
                "run/export/model.safetensors", f"{TAG}/mp_rank_00_model_states.pt",
                "good.jsonl", "prompts.txt", "run/checkpoints/latest"]
SAFETENSORS = "run/export/model.safetensors"


def build_seed_corpus(root: Path, tiny_data: dict, env: dict) -> Path:
    """The seed folder under `root` (see the module docstring)."""
    from conftest import console_script, tiny_config_dict

    seed = root / "seed"
    seed.mkdir()
    shutil.copy(tiny_data["tokenizer"], seed / "tok.model")
    shutil.copytree(tiny_data["path"], seed / "shards")
    config = tiny_config_dict({"path": "shards", "tokenizer": "tok.model"}, "out/runs")
    config["train"].update(max_steps=2, checkpoint={"every": 1, "keep": 2})
    config["eval"].update(after_train=True, depths=[1, 2], max_batches=1)
    (seed / "tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    trained = dict(config, output_dir="trained", name="run")
    (seed / "trained.yaml").write_text(yaml.safe_dump(trained, sort_keys=False))
    done = subprocess.run(console_script("scse-train") + ["--config", "trained.yaml"], cwd=seed,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (seed / "trained" / "run").rename(seed / "run")
    (seed / "trained").rmdir()
    (seed / "trained.yaml").unlink()
    # a command launching the trained run's own config writes into out/ too
    run_config = yaml.safe_load((seed / "run" / "config.yaml").read_text())
    run_config["output_dir"] = "out/runs"
    (seed / "run" / "config.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    spec = {"name": "s", "out": "out/studies", "base": "tiny.yaml", "seeds": [0],
            "variants": {"scse": {"overrides": {"model.recurrence": "scse"}},
                         "additive": {"overrides": {"model.recurrence": "additive"}}},
            "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    (seed / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (seed / "good.jsonl").write_text('{"text": "the cat sees the red ball today."}\n'
                                     '{"text": "a dog finds a green box at night."}\n')
    (seed / "prompts.txt").write_text("the cat\na dog finds\n")
    (seed / "out").mkdir()
    return seed


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root but out/ (and links as their target)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != "out"]
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            path = Path(dirpath) / name
            found[str(rel / name)] = hashlib.sha256(path.read_bytes()).hexdigest() \
                if path.is_file() else f"-> {os.readlink(path)}"
    return found


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# -- file mutations ----------------------------------------------------------------------------


def _keypaths(value, prefix=()) -> list[tuple]:
    """Every key path into nested dicts (lists by index), the containers themselves included."""
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, inner in value.items():
            paths += _keypaths(inner, (*prefix, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value[:3]):
            paths += _keypaths(inner, (*prefix, i))
    return paths


def _set(tree, path: tuple, value, delete: bool = False):
    """tree with the value at `path` replaced (or deleted); a path that is gone: unchanged."""
    if not path:
        return value
    node = tree
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return tree
    try:
        if delete:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        pass
    return tree


def _read_safetensors(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def mutate(root: Path, mutation: tuple) -> None:
    """Apply one (kind, path, *params) mutation to the file `root/path`."""
    kind, rel, *params = mutation
    path = root / rel
    if not path.is_file():
        return
    data = path.read_bytes()
    if kind == "delete":
        path.unlink()
        return
    if kind == "flip":  # params: position as a fraction of the size, the new byte
        at = min(int(params[0] * len(data)), max(len(data) - 1, 0))
        data = data[:at] + bytes([params[1]]) + data[at + 1:] if data else bytes([params[1]])
    elif kind == "truncate":
        data = data[:int(params[0] * len(data))]
    elif kind == "text":
        data = params[0].encode("utf-8", "surrogatepass")
    elif kind in ("yaml_set", "yaml_del", "json_set", "json_del"):
        try:
            tree = (yaml.safe_load if kind.startswith("yaml") else json.loads)(data)
        except (ValueError, yaml.YAMLError):  # an earlier mutation broke the syntax
            return
        tree = _set(tree, tuple(params[0]), params[1] if kind.endswith("set") else None,
                    delete=kind.endswith("del"))
        data = (yaml.safe_dump(tree, sort_keys=False).encode() if kind.startswith("yaml")
                else json.dumps(tree).encode())
    elif kind == "st_header":  # the safetensors JSON header, at params[0], set to params[1]
        try:
            header, body = _read_safetensors(data)
        except (ValueError, struct.error):
            return
        encoded = json.dumps(_set(header, tuple(params[0]), params[1])).encode()
        data = struct.pack("<Q", len(encoded)) + encoded + body
    elif kind == "st_length":
        data = struct.pack("<Q", params[0]) + data[8:]
    path.write_bytes(data)


# -- strategies ------------------------------------------------------------------------------

# numbers as small as a tiny model needs: a config a command builds a model from must not ask
# for gigabytes (out-of-range values are negative, zero or just too large for the tiny run)
SMALL_VALUES = (st.none() | st.booleans() | st.integers(-3, 70) |
                st.floats(-1e3, 1e3, allow_subnormal=False) | st.text(max_size=6) |
                st.lists(st.integers(-2, 5), max_size=2) | st.just({"k": 1}))
FRACTION = st.floats(0, 1, allow_subnormal=False)  # a position in a file


def file_mutations(seed: Path, files: list[str]) -> st.SearchStrategy:
    """Mutations of `files` (paths relative to the seed folder), by the kind of each file."""
    options = []
    for rel in files:
        if rel in YAML_FILES or rel in JSON_FILES:
            tree = (yaml.safe_load if rel in YAML_FILES else json.loads)((seed / rel).read_text())
            ext = "yaml" if rel in YAML_FILES else "json"
            paths = st.sampled_from(_keypaths(tree)).map(list)
            options += [st.tuples(st.just(f"{ext}_set"), st.just(rel), paths, SMALL_VALUES),
                        st.tuples(st.just(f"{ext}_del"), st.just(rel), paths)]
        if rel == SAFETENSORS:
            header, _ = _read_safetensors((seed / rel).read_bytes())
            paths = st.sampled_from(_keypaths(header)).map(list)
            options += [st.tuples(st.just("st_header"), st.just(rel), paths, SMALL_VALUES),
                        st.tuples(st.just("st_length"), st.just(rel),
                                  st.sampled_from([0, 7, 2**20, 2**63]))]
        options += [st.tuples(st.just("flip"), st.just(rel), FRACTION, st.integers(0, 255)),
                    st.tuples(st.just("truncate"), st.just(rel), FRACTION.map(lambda f: f * .99)),
                    st.tuples(st.just("text"), st.just(rel),
                              st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)),
                    st.tuples(st.just("delete"), st.just(rel))]
    return st.one_of(options)


@dataclass
class Outcome:
    status: object
    stdout: str
    stderr: str


def run_in_process(main: Callable, argv: list[str], cwd: Path) -> Outcome:
    """main(argv) with cwd, os.environ, sys.argv and torch's thread count restored afterwards;
    an exception that escapes is the traceback a user would see."""
    import torch

    saved = (os.getcwd(), dict(os.environ), list(sys.argv), torch.get_num_threads())
    out, err = io.StringIO(), io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(argv))
            except SystemExit as exc:  # argparse (2, or 0 after --help)
                status = exc.code if isinstance(exc.code, int) else (exc.code is not None)
            except BaseException:  # noqa: BLE001 (KeyboardInterrupt would be a traceback too)
                import traceback

                traceback.print_exc()
                status = "raised"
    finally:
        os.chdir(saved[0])
        os.environ.clear()
        os.environ.update(saved[1])
        sys.argv[:] = saved[2]
        torch.set_num_threads(saved[3])
    return Outcome(status, out.getvalue(), err.getvalue())
