"""The docs match the package: docs/architecture.md's layout names every module of scse_dist,
every relative link of README.md, docs/ and research/ resolves (file and heading), and none of
those pages cites a project file that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
         *sorted((REPO / "research").glob("*.md"))]
# A path the docs cite: under one of the project's own folders, ending in a file's suffix.
CITED = re.compile(r"(?<![\w./-])((?:scse_dist|configs|benchmarks|tests|slurm|launch|docs|research)"
                   r"/[\w./-]*\w\.(?:py|yaml|md|sh|json|png|txt))\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A page named bare in backquotes (`report.md`): some file of the project has that name.
CITED_PAGE = re.compile(r"`([\w.-]+\.md)`")
# Cited paths that stand for the user's own file, not one of the project's.
PLACEHOLDERS = {"scse_dist/eval/mytask.py",  # architecture.md: where a new task would go
                "configs/deepspeed/zeroN.json", "configs/x.yaml", "research/specs/NAME.yaml"}


def layout_entries(text: str) -> set[str]:
    """The paths the layout block lists (`scse_dist/train/loop.py`, `scse_dist/hf/`): an entry is
    a name at an even indent, its parents the entries above it at smaller indents; description
    lines continue deeper, at the description column."""
    block = re.search(r"^## Layout\n+```\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "docs/architecture.md has no ## Layout block"
    entries, parents = set(), []  # parents: (indent, path) of the open folders
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        name = line.split()[0] if line.strip() else ""
        if indent >= 20 or not re.fullmatch(r"[\w.-]+(/[\w.-]+)*(\.py|/)", name):
            continue  # a description's continuation
        parents = [(i, p) for i, p in parents if i < indent]
        path = (parents[-1][1] if parents else "") + name
        entries.add(path)
        if name.endswith("/"):
            parents.append((indent, path))
    return entries


def test_the_layout_names_every_module():
    """Each module is listed, or lies in a folder listed as one entry (hf/, backends/, ...)."""
    listed = layout_entries((REPO / "docs" / "architecture.md").read_text())
    folders_listed_whole = {e for e in listed if e.endswith("/")
                            and not any(o != e and o.startswith(e) for o in listed)}
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "scse_dist").rglob("*.py")
                     if p.name != "__init__.py")
    missing = [m for m in modules if m not in listed
               and not any(m.startswith(folder) for folder in folders_listed_whole)]
    assert not missing, f"modules docs/architecture.md's layout does not name: {missing}"
    gone = sorted(e for e in listed if e.startswith("scse_dist/") and not (REPO / e).exists())
    assert not gone, f"docs/architecture.md's layout names what the package lacks: {gone}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_doc_cites_a_missing_project_file(page):
    text = page.read_text()
    missing = sorted({path for path in CITED.findall(text)
                      if not (REPO / path).exists() and path not in PLACEHOLDERS})
    names = {p.name for p in REPO.rglob("*.md") if not {".git", ".venv"} & set(p.parts)}
    missing += sorted(set(CITED_PAGE.findall(text)) - names)
    assert not missing, f"{page.relative_to(REPO)} cites files the project does not have: {missing}"
