"""What the user docs claim holds: command-output samples are what the commands print today,
tables render whole, pages stay short, the docs speak to users, and the named facts (the CLI that
downloads from the Hugging Face Hub, the CPU wheel index, what `activation_checkpointing: auto`
picks for gpt2-small-scse, what config.md says a shipped config sets) are the code's."""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_PAGE_LINES = 600

# (page, first line of an output sample, argv that prints it or None: the page's last bash
# command before the sample). Each sample line must be a line of the output.
SAMPLES = [
    ("docs/training.md", "dry run of quickstart:", None),
    ("docs/training.md", "global batch 512 seq", None),
    ("docs/training.md", "scse-launch: config error:",
     ["scse-launch", "configs/gpt2-small-scse.yaml", "resources.nodes=3"]),
    ("docs/launching.md", "plan: gpt2-medium-scse", None),
]
ENTRY_POINTS = {"scse-train": "scse_dist.train.cli", "scse-launch": "scse_dist.launch.scheduler"}


def blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, start offset) of every fenced block."""
    return [(m.group(1), m.group(2), m.start())
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)]


def sample_and_command(page: str, first: str) -> tuple[list[str], list[str] | None]:
    """The sample block that starts with `first` and the last `--dry-run` or `--plan` command of
    the bash block before it (continuation lines joined)."""
    found = blocks((REPO / page).read_text())
    at = next(i for i, (lang, body, _) in enumerate(found)
              if not lang and body.startswith(first))
    bash = "".join(body for lang, body, _ in found[:at] if lang == "bash").replace("\\\n", " ")
    commands = [line for line in bash.splitlines() if re.search(r" --(dry-run|plan)\b", line)]
    argv = shlex.split(re.sub(r"\s+#.*$", "", commands[-1])) if commands else None
    return found[at][1].splitlines(), argv


def run_documented(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argv as a user types it (`scse-train`, `python launch/train.py`), run in this process
    (the cwd is the test's); what it printed."""
    module = "scse_dist.train.cli" if argv[0] == "python" else ENTRY_POINTS[argv[0]]
    args = argv[2:] if argv[0] == "python" else argv[1:]
    capsys.readouterr()
    try:
        importlib.import_module(module).main(args)
    except SystemExit:
        pass
    out, err = capsys.readouterr()
    return out + err


def squeeze(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.parametrize("page,first,argv", SAMPLES, ids=[f"{p}:{f}" for p, f, _ in SAMPLES])
def test_output_samples_are_what_the_commands_print(tmp_path, monkeypatch, capsys, page, first,
                                                    argv):
    """Run from a fresh directory holding the configs, as a user with a new clone would: the
    data is not built there, which the quickstart's sample says."""
    sample, documented = sample_and_command(page, first)
    argv = argv or documented
    assert argv, f"{page}: no command for the sample {first!r}"
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    printed = {squeeze(line) for line in run_documented(argv, capsys).splitlines()}
    stale = [line for line in sample if squeeze(line) not in printed]
    assert not stale, f"{page}: sample lines the command no longer prints:\n" + "\n".join(stale)


def test_the_sample_finder_reads_the_block_after_its_command():
    sample, argv = sample_and_command("docs/training.md", "dry run of quickstart:")
    assert argv == ["python", "launch/train.py", "--config", "configs/quickstart.yaml",
                    "--dry-run"]  # not the --print-config after it in the same block
    assert sample[0].startswith("dry run of quickstart:") and len(sample) == 9
    sample, argv = sample_and_command("docs/launching.md", "plan: gpt2-medium-scse")
    assert argv[:4] == ["scse-train", "--config", "configs/gpt2-small-scse.yaml", "--plan"]
    assert "train.engine.deepspeed_config=configs/deepspeed/zero2.json" in argv


def table_breaks(text: str) -> list[int]:
    """Line numbers of table rows that no table holds: a `|` row after a line that ended the
    table above it (prose, or a blank line), which Markdown renders as text."""
    lines, stray, in_table, fenced = text.splitlines(), [], False, False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        row = not fenced and line.strip().startswith("|")
        header = row and number < len(lines) and re.fullmatch(r"\s*\|[-:| ]+\|\s*", lines[number])
        if row and not in_table and not header:
            stray.append(number)
        in_table = bool(row and (in_table or header))
    return stray


def test_the_table_check_finds_a_split_table():
    whole = "| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |\n\nprose\n"
    assert table_breaks(whole) == []
    assert table_breaks("| a | b |\n|---|---|\n| 1 | x |\nprose\n| 2 | y |\n") == [5]
    assert table_breaks("| a | b |\n|---|---|\n| 1 | x |\n\n| 2 | y |\n") == [5]
    assert table_breaks("```\n| not | a table |\n```\n") == []


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_table_is_whole(page):
    assert not table_breaks(page.read_text()), \
        f"{page.relative_to(REPO)}: table rows cut off from their table at lines " \
        f"{table_breaks(page.read_text())}"


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_is_short(page):
    lines = page.read_text().count("\n")
    assert lines <= MAX_PAGE_LINES, f"docs/{page.name}: {lines} lines; split it by topic"


# Words for the project's own history and machines, not for a user.
NOT_FOR_USERS = [r"\bissues? #?\d+", r"\bissue-\d+", r"\bthis round\b", r"\bfirst round\b",
                 r"\blent (GPU|machine)", r"\bload average (was )?\d", r"\bsessions?\b",
                 r"\bstop \d+x\b", r"\bthe lead\b", r"\.\./shared\b"]


def user_text(page: Path) -> str:
    """The page with link targets dropped: a link into research/ may name an issue's heading."""
    return re.sub(r"\]\([^)\s]*\)", "]()", page.read_text())


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_speak_to_users(page):
    found = [m.group(0) for pattern in NOT_FOR_USERS
             for m in re.finditer(pattern, user_text(page), flags=re.I)]
    assert not found, f"{page.relative_to(REPO)}: {found}"


def test_no_doc_names_huggingface_cli():
    """huggingface_hub's command line is `hf` (`hf download`); `huggingface-cli` is gone."""
    files = [*USER_PAGES, *(REPO / "configs").rglob("*.yaml"), *(REPO / "slurm").glob("*.sh"),
             *(REPO / "scse_dist").rglob("*.py")]
    named = [str(f.relative_to(REPO)) for f in files if "huggingface-cli" in f.read_text()]
    assert not named, f"these name huggingface-cli (now `hf download`): {named}"
    hf = Path(sys.executable).parent / "hf"
    if hf.exists():  # the installed huggingface_hub has the command the docs name
        assert subprocess.run([str(hf), "download", "--help"], capture_output=True).returncode == 0


def test_readme_says_where_the_cpu_build_of_torch_comes_from():
    readme = (REPO / "README.md").read_text()
    assert "pip install torch==2.13.0 setuptools wheel" in readme  # the command CI runs
    assert "--index-url https://download.pytorch.org/whl/cpu" in " ".join(readme.split())


def test_gpt2_small_scse_checkpoints_nothing_on_h100s():
    """docs/launching.md: the config's `auto` picks none on one H100 and on 16, and loop where
    the estimate does not fit."""
    from scse_dist.config import load_config
    from scse_dist.train.plan import GPUS, Assumptions
    from scse_dist.train.sizing import checkpointing_for

    cfg = load_config(str(REPO / "configs" / "gpt2-small-scse.yaml"))
    assert cfg.model.activation_checkpointing == "auto"
    h100 = GPUS["h100"].memory_mib * 2**20
    budget = Assumptions().memory_fraction * h100
    sections = cfg.model, cfg.data, cfg.train
    assert [checkpointing_for(*sections, world, "bf16", budget, h100) for world in (1, 16)] \
        == ["none", "none"]
    assert checkpointing_for(*sections, 1, "bf16", budget / 8, h100) == "loop"
    launching = " ".join((REPO / "docs" / "launching.md").read_text().split())
    assert "On one H100, or 16, that is none" in launching


def test_what_config_md_says_a_shipped_config_sets():
    """A row of docs/config.md that says "`configs/X.yaml` sets `V`" holds: X's field is V."""
    from scse_dist.config import load_config

    claims = []
    for row in (REPO / "docs" / "config.md").read_text().splitlines():
        field = re.match(r"\| `([\w.]+)` \|", row)
        for config, value in re.findall(r"`(configs/[\w./-]+\.yaml)` sets `([^`]+)`", row):
            assert field, f"config.md: {config} sets {value} outside a field's row"
            claims.append((field.group(1), config, value))
    assert claims  # the check reads the rows it means to
    for field, config, value in claims:
        got = functools.reduce(getattr, field.split("."), load_config(str(REPO / config)))
        assert str(got) == value, f"docs/config.md: {config} sets {field}: {got}, not {value}"
