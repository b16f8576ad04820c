"""Every command answers `--help` at once: neither torch nor DeepSpeed is imported (2.5 s of CPU
for torch alone, 4-13 s on a loaded machine), and the help's description is a whole paragraph,
never a line cut mid-sentence.

Each case is a real process of the console script as a user runs it (or `python launch/train.py`),
with Python's import profile telling what it loaded.
"""

from __future__ import annotations

import sys
import tomllib

import pytest

from conftest import REPO_ROOT, console_script, run_profiling_imports

SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# scse-lm-eval prints its model and tasks, then lm-eval's help (lm-eval's usage and description).
OWN_HELP = sorted(set(SCRIPTS) - {"scse-lm-eval"})


def command(name: str) -> list[str]:
    if name == "launch/train.py":
        return [sys.executable, str(REPO_ROOT / "launch" / "train.py")]
    return console_script(name)


def description(help_text: str) -> str:
    """The paragraph after the usage lines."""
    return help_text.split("\n\n")[1]


@pytest.mark.parametrize("name", [*sorted(SCRIPTS), "launch/train.py"])
def test_help_imports_neither_torch_nor_deepspeed(name, subprocess_env):
    proc = run_profiling_imports(command(name) + ["--help"], subprocess_env, cwd=REPO_ROOT,
                                 timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    assert not proc.imported & {"torch", "deepspeed"}, sorted(proc.imported)


@pytest.mark.parametrize("name", OWN_HELP)
def test_help_description_is_whole_sentences(name, subprocess_env):
    proc = run_profiling_imports(command(name) + ["--help"], subprocess_env, cwd=REPO_ROOT,
                                 timeout=120)
    text = description(proc.stdout)
    assert text.rstrip().endswith("."), f"{name} --help description is cut: {text!r}"
