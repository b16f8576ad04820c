"""The task names lm-eval would accept, read without importing lm_eval, so an unknown `--tasks`
name is one line before lm-eval's slow start (and its traceback).

lm-eval's index (lm_eval.tasks.TaskIndex) names a task by a config's `task:`, a group by its
`group:`, and a tag by each of its `tag:` values, in its own task dir and the --include_path
dir. A line scan of every file there (an include has any name) for those keys, a scalar, a
[flow, list] or `- item` lines, finds a superset of its names (tests/test_lmeval_cli.py).
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.util
import os
import re
from pathlib import Path
from typing import Iterable, Optional

_KEY = re.compile(r"""^[ \t]*["']?(task|group|tag)["']?[ \t]*:[ \t]*(.*?)[ \t]*(?:#.*)?$"""
                  r"""((?:\n[ \t]*-[ \t]*.*$)*)""", re.M)
_ITEM = re.compile(r"""^[ \t]*-[ \t]*["']?([^"'\n#]*?)["']?[ \t]*(?:#.*)?$""", re.M)
_NOT_CONFIG = (".py", ".pyc", ".md", ".json", ".jsonl", ".txt", ".csv", ".tsv", ".png")


def lm_eval_tasks_dir() -> Optional[str]:
    """lm-eval's own task dir, found without importing lm_eval; None when it is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(list(spec.submodule_search_locations)[0]) / "tasks")


def task_names(dirs: Iterable[str]) -> set[str]:
    """Every name a `task:`, `group:` or `tag:` line of a file under `dirs` gives (a superset of
    what lm-eval indexes there)."""
    names: set[str] = set()
    for root in dirs:
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith(_NOT_CONFIG):
                    continue
                with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                for key, value, items in _KEY.findall(text):
                    if value.startswith("["):
                        names.update(v.strip(" '\"") for v in value.strip("[]").split(","))
                    elif value:
                        names.add(value.strip("'\""))
                    if key == "tag":
                        names.update(_ITEM.findall(items))
    return names


def unknown_tasks(requested: list[str], known: set[str]) -> list[str]:
    """The requested names that match no known name (lm-eval matches fnmatch patterns); a path to
    a YAML file or a directory of them is lm-eval's to read."""
    return [t for t in requested
            if not (t.endswith(".yaml") or os.path.isdir(t) or fnmatch.filter(known, t))]


def did_you_mean(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
