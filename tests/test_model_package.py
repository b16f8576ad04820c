"""The model package stands alone: it imports nothing of scse_dist outside itself, so it can be
copied verbatim, under another name, into an export as remote code and give the same logits."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import scse_dist.model
from conftest import WITHOUT_SCSE_DIST
from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

PACKAGE = Path(scse_dist.model.__file__).parent


def test_model_package_imports_only_itself() -> None:
    outside = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            outside += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "scse_dist"]
    assert outside == []
    assert (PACKAGE / "config.py").is_file() and (PACKAGE / "transitions.py").is_file()


def test_package_copied_under_another_name_builds_the_same_model(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "copied_looped_model",
                    ignore=shutil.ignore_patterns("__pycache__"))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_core=2, depth=3)
    model = LoopedLM(cfg).eval()
    tokens = torch.randint(0, 64, (2, 10))
    torch.save({"state": model.state_dict(), "tokens": tokens}, tmp_path / "in.pt")
    script = WITHOUT_SCSE_DIST + """
sys.path.insert(0, sys.argv[1])
import torch
from copied_looped_model import LoopedLM, ModelConfig
data = torch.load(sys.argv[1] + "/in.pt")
model = LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_core=2, depth=3)).eval()
model.load_state_dict(data["state"])
with torch.no_grad():
    torch.save(model(data["tokens"], depth=5).logits, sys.argv[1] + "/out.pt")
assert not any(m.split(".")[0] == "scse_dist" for m in sys.modules)
"""
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=tmp_path,
                   env={"PATH": "/usr/bin:/bin"})
    with torch.no_grad():
        want = model(tokens, depth=5).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)
