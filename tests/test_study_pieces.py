"""A study run in pieces (`--variants a`, then `--variants b`) and then `scse-study --report`
writes the same record and the same report as the study run in one go: runs.json merges every
submission, the rate choice merges per variant, the validation stage scores every finished run,
and the pre-registered comparison comes first. Runs not run yet are listed, never dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, tiny_documents


def study(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scse_dist.study.cli", *args],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=env)


def spec_file(tmp_path: Path, base: str, out: str) -> str:
    spec = {"name": "pieces", "out": out, "base": base,
            "variants": {"a": {"overrides": {"model.recurrence": "scse"}},
                         "b": {"overrides": {"model.recurrence": "additive"}}},
            "seeds": [1, 2],
            "validation": {"path": str(tmp_path / "valid.txt"), "depth": 2},
            "lr": {"values": [1e-4, 3e-3], "seed": 0},
            "pairs": [["a", "b"]],
            "preregistration": {"primary": {"pair": ["a", "b"], "task": "validation",
                                            "metric": "ppl", "depth": 2},
                                "secondary": [{"pair": ["a", "b"], "task": "heldout",
                                               "metric": "ppl", "depth": 1}]},
            "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    path = tmp_path / f"{Path(out).name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def record(d: Path) -> tuple[str, dict, list, dict]:
    """report.md, aggregate.json, runs.json and lr_choice.json with the study dir made neutral."""
    def neutral(text: str) -> str:
        return text.replace(str(d), "STUDY")

    return (neutral((d / "report" / "report.md").read_text()),
            json.loads(neutral((d / "report" / "aggregate.json").read_text())),
            json.loads(neutral((d / "runs.json").read_text())),
            json.loads(neutral((d / "lr_choice.json").read_text())))


@pytest.mark.slow
def test_a_study_run_in_pieces_reports_as_one_run_in_one_go(tmp_path, tiny_config, user_env):
    base = tiny_config(tmp_path, "train.max_steps=4", "train.checkpoint.every=4")
    (tmp_path / "valid.txt").write_text("\n\n".join(tiny_documents(8, seed=7)))
    whole = spec_file(tmp_path, base, str(tmp_path / "whole"))
    pieces = spec_file(tmp_path, base, str(tmp_path / "pieces"))
    d = tmp_path / "pieces" / "pieces"

    nothing = study(pieces, "--report", env=user_env)
    assert nothing.returncode == 66 and nothing.stderr == (
        f"scse-study: --report: {d / 'runs.json'}: no such file (nothing of this study has run "
        "yet)\n")
    bad = study(pieces, "--variants", "a,c", "--dry-run", env=user_env)
    assert bad.returncode == 2 and bad.stderr == \
        "scse-study: --variants: 'c' is not a variant of the spec (known: a, b)\n"

    first = study(pieces, "--variants", "a", "--local", env=user_env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("] starting ") == 4  # a's 2 sweep runs and 2 seeds, no more
    report = (d / "report" / "report.md").read_text()
    assert "- b/seed1 (final, " in report and "no run dir (never started)" in report
    assert json.loads((d / "lr_choice.json").read_text()).keys() == {"a"}

    second = study(pieces, "--variants", "b", "--local", env=user_env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("] starting ") == 4
    again = study(pieces, "--report", env=user_env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "] starting " not in again.stdout and "validation: scored" not in again.stdout

    one = study(whole, "--local", env=user_env)
    assert one.returncode == 0, one.stdout + one.stderr
    split, together = record(d), record(tmp_path / "whole" / "pieces")
    assert split[2] == together[2]  # runs.json: every run, in the spec's order
    assert len(split[2]) == 8 and split[3] == together[3]  # lr_choice.json
    assert split[1] == together[1]  # aggregate.json
    assert split[0] == together[0]  # report.md
    md = split[0]
    assert md.index("## Pre-registration") < md.index("## Pathology flags")
    assert "| **primary** | a - b | validation ppl | 2 |" in md
    assert "| secondary | a - b | heldout ppl | 1 |" in md
    assert "## validation ppl (lower is better)" in md and "Missing or failed" not in md
    valid = json.loads((d / "a/a-seed1/eval/validation.json").read_text())
    assert [r["depth"] for r in valid["results"]] == [1, 2]  # the study's depths
    sweep = json.loads((d / "a/a-lr0.003-seed0/eval/validation.json").read_text())
    assert [r["depth"] for r in sweep["results"]] == [2]  # validation.depth chooses the rate
