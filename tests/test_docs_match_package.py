"""The docs match the package: docs/architecture.md's layout names every module of scse_dist,
every relative link of README.md, docs/ and research/ resolves (file and heading), and none of
those pages cites a project file that does not exist, README and docs name no file outside the
checkout (`../shared/...`), and README, docs, configs and the Slurm scripts name config keys by
their current names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from scse_dist.config import RENAMED_FIELDS
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule_config import ScheduleConfig

REPO = Path(__file__).resolve().parents[1]
USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGES = [*USER_PAGES, *sorted((REPO / "research").glob("*.md"))]
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
    """Each module is an entry of its own: a folder's entry does not stand for its modules."""
    listed = layout_entries((REPO / "docs" / "architecture.md").read_text())
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "scse_dist").rglob("*.py")
                     if p.name != "__init__.py")
    missing = [m for m in modules if m not in listed]
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


# A `../` path in prose or code (`../shared/data/x.txt`, `out: ../../studies`).
UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")
PROJECT_DIRS = [REPO, *(d for d in REPO.rglob("*") if d.is_dir()
                        and not {".git", ".venv", "__pycache__"} & set(d.relative_to(REPO).parts))]


def outside_the_project(path: str) -> bool:
    """Whether `path` lands outside the checkout from every folder of it (the page's own, or the
    one a config or spec that holds it lives in): a file a clone does not have, nor builds
    under data/."""
    for folder in PROJECT_DIRS:
        target = (folder / path).resolve()
        if target.is_relative_to(REPO) and (target.exists() or target.parent.exists()
                                            or target.is_relative_to(REPO / "data")):
            return False  # a clone's file, or data/ that a user builds or downloads
    return True


def test_the_outside_check_tells_a_clones_files_from_others():
    assert outside_the_project("../shared/data/lambada/dev.txt")
    assert outside_the_project("../../shared/tools/gpu-check.sh")
    assert not outside_the_project("../research/scse-robustness-log.md")
    assert not outside_the_project("../../studies")  # an output folder beside configs/
    assert UP_PATH.findall("`../shared/x.txt` and [log](../research/a.md#h)") == [
        "../shared/x.txt", "../research/a.md"]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_user_doc_relies_on_files_outside_the_checkout(page):
    """A clone has only the repository: a doc that reads `../shared/...` says how to get it."""
    outside = sorted({p for p in UP_PATH.findall(page.read_text()) if outside_the_project(p)})
    assert not outside, f"{page.relative_to(REPO)} names files outside the checkout: {outside}"


# --- Config keys by their current names ----------------------------------------------------------
# docs/config.md lists the renames on purpose between these two comments; nowhere else names an
# old key, since the package reads those only with a `config: notice:` line.
OLD_NAMES_LIST = re.compile(r"<!-- old names: -->.*?<!-- /old names -->", flags=re.S)
KEY_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "configs").rglob("*.yaml")), *sorted((REPO / "slurm").glob("*.sh"))]
# Old names that are also the new section's name: old only with a kind as their value.
OLD_KINDS = {"train.optimizer": get_args(get_type_hints(OptimizerConfig)["kind"]),
             "train.schedule": get_args(get_type_hints(ScheduleConfig)["kind"])}
YAML_KEY = re.compile(r"^( *)(?:- )?([\w-]+):[ \t]*([^#\s][^#]*?)?[ \t]*(?:#.*)?$")


def _old_use(old: str, after: str) -> bool:
    """Whether `old` followed by `after` names the old key, not the new section of that name
    (`train.optimizer.lr`, `train.optimizer: {kind: muon}`)."""
    if old not in OLD_KINDS:
        return True
    value = re.match(r"""\s*[:=]\s*["']?([\w-]+)""", after)
    return value is not None and value.group(1) in OLD_KINDS[old]


def _dotted_old_names(text: str) -> list[tuple[int, str]]:
    """(line, name) of each `train.lr`-style mention of an old name, in prose, code or comments."""
    names = "|".join(re.escape(old) for old in sorted(RENAMED_FIELDS, key=len, reverse=True))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(rf"(?<![\w.])({names})(?!\w)", text)
            if _old_use(m.group(1), text[m.end():m.end() + 40])]


def _nested_old_names(lines: list[str], first_line: int) -> list[tuple[int, str]]:
    """(line, name) of each YAML key whose nesting spells an old name (`train:` / `  lr: 3e-3`)."""
    found: list[tuple[int, str]] = []
    open_keys: list[tuple[int, str]] = []  # (indent, dotted path) of the enclosing mappings
    for number, line in enumerate(lines, first_line):
        key = YAML_KEY.match(line)
        if not key:
            continue
        indent, name, value = len(key.group(1)), key.group(2), key.group(3)
        open_keys = [(i, p) for i, p in open_keys if i < indent]
        path = f"{open_keys[-1][1]}.{name}" if open_keys else name
        open_keys.append((indent, path))
        if path in RENAMED_FIELDS and (path not in OLD_KINDS or (value or "") in OLD_KINDS[path]):
            found.append((number, path))
    return found


def _blank_old_names_list(text: str) -> str:
    """The text with the marked list of renames blanked, its lines kept (for the line numbers)."""
    return OLD_NAMES_LIST.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def old_names_in(page: Path) -> list[str]:
    text = page.read_text()
    if page == REPO / "docs" / "config.md":
        text = _blank_old_names_list(text)
    found = _dotted_old_names(text)
    if page.suffix == ".yaml":
        found += _nested_old_names(text.splitlines(), 1)
    for block in re.finditer(r"^```ya?ml\n(.*?)^```", text, flags=re.S | re.M):
        found += _nested_old_names(block.group(1).splitlines(),
                                   text.count("\n", 0, block.start(1)) + 1)
    where = page.relative_to(REPO)
    return [f"{where}:{line}: {old} (now {RENAMED_FIELDS[old]})" for line, old in sorted(found)]


def test_the_old_name_finder_tells_old_from_new():
    """The check below finds what it should: old flat names, old nesting, old kinds; and
    passes the new names, sections and the text between the rename markers."""
    text = ("`train.lr=3e-3` and train.optimizer: muon, train.schedule=wsd, train.resume.\n"
            "train.optimizer.lr, train.schedule.kind: wsd, train.start.resume, train.lr_mult.x=4\n"
            "train.optimizer: {kind: muon}, train.schedule: step 13 runs, warmup_steps\n")
    assert _dotted_old_names(text) == [(1, "train.lr"), (1, "train.optimizer"),
                                       (1, "train.schedule"), (1, "train.resume"),
                                       (2, "train.lr_mult")]
    yaml_text = ("train:\n  lr: 1.0  # x\n  optimizer:\n    lr: 2.0\n  schedule: wsd\n"
                 "  start:\n    resume: auto\neval:\n  slurm_gpus: 1\n")
    assert _nested_old_names(yaml_text.splitlines(), 10) == [
        (11, "train.lr"), (14, "train.schedule"), (18, "eval.slurm_gpus")]
    listed = "<!-- old names: -->\n`train.lr` is `train.optimizer.lr`\n<!-- /old names -->\n"
    assert _dotted_old_names(_blank_old_names_list(listed + "train.lr")) == [(4, "train.lr")]


def test_docs_and_configs_name_keys_by_their_current_names():
    """README, docs, configs and the Slurm scripts say `train.optimizer.lr`, not `train.lr`: the
    old names load only with a notice (scse_dist/config.py's RENAMED_FIELDS)."""
    old = [hit for page in KEY_PAGES for hit in old_names_in(page)]
    assert not old, "old config names (rename them):\n" + "\n".join(old)
