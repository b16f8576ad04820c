"""The package's import graph: acyclic, and layered so that nothing imports upward.

The layers are written down once, as pyproject.toml's [tool.importlinter] contracts, which
`lint-imports` checks (CI runs it; test_the_contracts_hold runs it here). import-linter sees
packages; this file reads the same layers module by module, from the source (imports inside
functions and under TYPE_CHECKING alike, relative imports resolved, no torch imported), for what a
package-level contract cannot say: a package's own `config` module (data/config.py,
train/config.py, eval/config.py, launch/config.py: its section of the run config), or a
`<name>_config` one for a section beside its code (train/optimizer_config.py,
train/metrics_config.py, checkpoint/start_config.py, ...), sits in the config layer, not its
package's. `scse_dist.config` composes the sections, and whatever reads a config
imports them without loading the package, so a section imports only the config layer and below.
That is why the layers contract may ignore imports of the sections, and only those.
A package's __init__ importing its own submodules is the usual pattern, not a cycle.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import scse_dist

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

ROOT = Path(scse_dist.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"
CONTRACTS = {c["id"]: c for c in
             tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]}
# The layers contract's layers, lowest first: each a set of top-level names (model, config, ...).
LAYERS = [{name.strip().removeprefix("scse_dist.") for name in re.split(r"[|:]", layer)}
          for layer in reversed(CONTRACTS["layers"]["layers"])]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, with `from .x import` resolved against `name`'s package."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """scse_dist modules that `name` imports anywhere in its source (with their packages)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(name, path, node)
            named.add(module)
            named.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
    # importing a module imports its packages too, except that a section config's package is
    # light by contract (test_section_packages_import_nothing): it counts as the config layer's
    with_packages = {".".join(m.split(".")[:i]) for m in named
                     for i in range(3 if _in_section(m) else 2, m.count(".") + 2)}
    return {m for m in with_packages if m in modules and m != name and not name.startswith(m + ".")}


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that can reach itself, with the path it takes back (depth-first)."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(path + [start])
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def _in_section(name: str) -> bool:
    """Whether `name` is a package's section config (scse_dist.train.config,
    scse_dist.train.optimizer_config) or a name in it."""
    parts = name.split(".")
    return len(parts) >= 3 and (parts[2] == "config" or parts[2].endswith("_config")) \
        and parts[1] not in LAYERS[0]


def _top(module: str) -> str:
    if _in_section(module):
        return "config"  # a package's section of the run config: below the package
    return module.split(".")[1] if module.count(".") else ""


def _layer(module: str) -> int:
    top = _top(module)
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of LAYERS")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if _top(a)
                  for b in deps if _top(b) and _layer(b) > _layer(a))


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for a, deps in graph.items():
        packages.setdefault(_top(a), set()).update(_top(b) for b in deps if _top(b) != _top(a))
    return packages


def test_no_import_cycles():
    graph = _graph()
    assert "scse_dist.data.sample_format" in graph and graph["scse_dist.data.reader"]
    # relative imports are seen: the model package imports itself only that way
    assert "scse_dist.model.config" in graph["scse_dist.model.blocks"]
    assert _cycles(graph) == []


def test_transitions_reach_the_core_through_their_own_protocol():
    """No circle transitions <-> recurrence, not even one of annotations: a Transition is handed
    the core as transitions.Core, so its module names nothing of the model but the config."""
    modules = _modules()
    seen = _imports("scse_dist.model.transitions", modules["scse_dist.model.transitions"], modules)
    assert seen == {"scse_dist.model.config"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()
             if m.startswith("scse_dist.model")}
    assert _cycles(graph) == []


def test_no_package_level_cycles():
    packages = _package_graph(_graph())
    assert "checkpoint" in packages["train"]
    assert _cycles(packages) == []


def test_no_module_imports_a_higher_layer():
    assert _upward(_graph()) == []


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package found first on the path from `cwd` (PYTHONPATH=cwd)."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    proc = _lint_imports(ROOT.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in proc.stdout


def test_the_contracts_ignore_only_imports_of_sections():
    """What import-linter, which sees packages, must be told: an import of a section (config
    layer) by the hub or by a module below the section's package; each one the code makes."""
    assert CONTRACTS["acyclic"]["ignore_imports"] == CONTRACTS["layers"]["ignore_imports"]
    assert not any("ignore_imports" in c for i, c in CONTRACTS.items() if i not in ("layers",
                                                                                   "acyclic"))
    ignored = [rule.split(" -> ") for rule in CONTRACTS["layers"]["ignore_imports"]]
    assert "scse_dist.config" in {a for a, _ in ignored}
    assert all(_in_section(b) and _layer(b) == _layer("scse_dist.config") for _, b in ignored)
    package = {name: LAYERS.index(names) for names in LAYERS for name in names}
    assert all(a == "scse_dist.config" or _layer(a) < package[b.split(".")[1]]
               for a, b in ignored)
    graph = _graph()
    assert all(b in graph[a] for a, b in ignored)


@pytest.mark.parametrize("rel, planted, broken", [
    ("data/packing.py", "from scse_dist.train.engine import build_engine",
     "scse_dist.data.packing -> scse_dist.train.engine"),  # a layer above
    ("progress.py", "from scse_dist.atomic import atomic_write",
     "scse_dist.progress -> scse_dist.atomic"),  # a leaf importing its own layer
    ("study/spec.py", "from scse_dist.study.runs import expand", "- .spec -> .runs"),  # a circle
])
def test_lint_imports_catches_a_planted_import(tmp_path, rel, planted, broken):
    copy = _plant(tmp_path, {rel: (ROOT / rel).read_text() + f"\n{planted}  # planted\n"})
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.read_text())
    proc = _lint_imports(copy.parent)
    assert proc.returncode == 1 and broken in proc.stdout, proc.stdout + proc.stderr
    assert "0 kept" not in proc.stdout  # the other contracts still hold


def test_benchmark_scripts_import_no_circle():
    """benchmarks/ are scripts beside each other (no package): none imports one that imports it."""
    scripts = {p.stem: p for p in (ROOT.parent / "benchmarks").glob("*.py")}
    graph = {name: {a.name.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Import) for a in node.names}
             | {(node.module or "").split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and not node.level}
             for name, path in scripts.items()}
    graph = {name: deps & set(scripts) - {name} for name, deps in graph.items()}
    assert "gpu_check_probes" in graph["gpu_check"]
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A copy of the package with `files` (relative path -> source) added or replaced."""
    import shutil

    copy = tmp_path / "scse_dist"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, source in files.items():
        (copy / rel).write_text(source)
    return copy


def test_a_planted_relative_cycle_in_model_is_caught(tmp_path):
    copy = _plant(tmp_path, {"model/loss.py": (ROOT / "model/loss.py").read_text()
                             + "\nfrom .looped_lm import LoopedLM  # planted\n"})
    cycles = _cycles(_graph(copy))
    assert any("scse_dist.model.loss" in c and "scse_dist.model.looped_lm" in c for c in cycles)


def test_a_planted_upward_import_is_caught(tmp_path):
    copy = _plant(tmp_path, {"data/packing.py": (ROOT / "data/packing.py").read_text()
                             + "\nfrom scse_dist.train.engine import build_engine  # planted\n"})
    assert _upward(_graph(copy)) == ["scse_dist.data.packing -> scse_dist.train",
                                     "scse_dist.data.packing -> scse_dist.train.engine"]


def test_section_configs_sit_in_the_config_layer():
    graph = _graph()
    sections = {"scse_dist.data.config", "scse_dist.train.config", "scse_dist.eval.config",
                "scse_dist.launch.config", "scse_dist.train.optimizer_config",
                "scse_dist.train.schedule_config", "scse_dist.train.depth_config",
                "scse_dist.train.loss_config", "scse_dist.train.metrics_config",
                "scse_dist.checkpoint.start_config", "scse_dist.checkpoint.save_config"}
    assert sections <= graph["scse_dist.config"] | graph["scse_dist.train.config"]
    assert {_layer(m) for m in sections} == {_layer("scse_dist.config")}


@pytest.mark.parametrize("package", ["scse_dist.data", "scse_dist.train", "scse_dist.eval",
                                     "scse_dist.checkpoint", "scse_dist.launch"])
def test_section_packages_import_nothing(package):
    # importing a section config runs its package's __init__: it must stay this light
    assert _graph()[package] == set()


def test_a_section_config_importing_its_package_is_caught(tmp_path):
    copy = _plant(tmp_path, {"train/config.py": (ROOT / "train/config.py").read_text()
                             + "\nfrom scse_dist.train.schedule import build_lr_scheduler"
                               "  # planted\n"})
    assert "scse_dist.train.config -> scse_dist.train.schedule" in _upward(_graph(copy))


def test_sample_format_is_shared_by_reader_and_writer():
    graph = _graph()
    assert "scse_dist.data.sample_format" in graph["scse_dist.data.reader"]
    assert "scse_dist.data.sample_format" in graph["scse_dist.data.shards"]


def test_config_validation_loads_no_torch(subprocess_env):
    """The commands check a config before torch loads: scse_dist.config and every section beside
    its package load and validate a config without torch (nor the packages' heavy modules)."""
    from conftest import REPO_ROOT, run_profiling_imports

    code = ("from scse_dist.config import load_config; "
            "load_config('configs/quickstart.yaml', ['train.max_steps=3', 'eval.tasks=[heldout]'])")
    proc = run_profiling_imports([sys.executable, "-c", code], subprocess_env, cwd=REPO_ROOT,
                                 timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "yaml" in proc.imported and not proc.imported & {"torch", "deepspeed", "numpy"}
