"""The package's import graph: no module imports another that (directly or not) imports it back.

Read from the source (module-level and function-level imports alike), so it costs no torch import.
A package's __init__ importing its own submodules is the usual pattern, not a cycle.
"""

import ast
from pathlib import Path

import scse_dist

ROOT = Path(scse_dist.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """scse_dist modules that `name` imports anywhere in its source (with their packages)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
    with_packages = {".".join(m.split(".")[:i]) for m in named for i in range(2, m.count(".") + 2)}
    return {m for m in with_packages if m in modules and m != name and not name.startswith(m + ".")}


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


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert "scse_dist.data.sample_format" in graph and graph["scse_dist.data.reader"]
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]


def test_sample_format_is_a_leaf():
    # reader.py and shards.py both import it; it must import neither (nor anything of scse_dist)
    modules = _modules()
    name = "scse_dist.data.sample_format"
    assert _imports(name, modules[name], modules) == set()
    assert name in _imports("scse_dist.data.reader", modules["scse_dist.data.reader"], modules)
    assert name in _imports("scse_dist.data.shards", modules["scse_dist.data.shards"], modules)
