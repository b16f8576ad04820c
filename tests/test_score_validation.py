"""benchmarks/score_validation.py: per-variant means and intervals merged across studies, the worst
depth ratios, paired differences, and one line for a seed that two studies both hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from train_procs import REPO

SCRIPT = str(REPO / "benchmarks" / "score_validation.py")


def _study(root, name, runs):
    """A study dir whose runs already hold eval/heldout.json: runs = {(variant, seed): {T: ppl}}."""
    study = root / name
    records = []
    for (variant, seed), ppl in runs.items():
        run_dir = study / variant / f"{variant}-seed{seed}"
        (run_dir / "eval").mkdir(parents=True)
        rows = [{"depth": d, "loss": 0.0, "ppl": p, "tokens": 100} for d, p in ppl.items()]
        (run_dir / "eval" / "heldout.json").write_text(json.dumps(
            {"task": "heldout", "results": rows, "complete": True}))
        records.append({"variant": variant, "seed": seed, "stage": "final",
                        "run_dir": str(run_dir)})
    study.mkdir(exist_ok=True)
    (study / "runs.json").write_text(json.dumps(records))
    return study


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                          text=True, cwd=REPO)


def test_variants_merge_across_studies_and_pairs_are_per_seed(tmp_path):
    a = _study(tmp_path, "a", {("scse", 0): {2: 110.0, 8: 100.0, 32: 101.0},
                               ("base", 0): {2: 105.0, 8: 105.0, 32: 105.0},
                               ("untied", 0): {8: 99.0}})  # a fixed-depth model: one T
    b = _study(tmp_path, "b", {("scse", 1): {2: 120.0, 8: 110.0, 32: 121.0},
                               ("base", 1): {2: 111.0, 8: 111.0, 32: 111.0}})
    done = _run(a, b, "--name", "heldout", "--pair", "scse", "base", "--json", tmp_path / "s.json")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    scse = next(line for line in lines if line.startswith("| scse |"))
    # T=8: mean 105, sd 7.07, t(0.975, 1) = 12.706 -> half-width 63.5 (paired: diffs -5, -1, sd
    # 2.83 -> 25.4); worst T8/T2 = 100/110
    # (seed 0: 0.909, seed 1: 0.917), worst T32/T8 = 121/110 = 1.1
    assert scse.split(" | ")[1:] == ["2", "115.0 ± 63.5", "105.0 ± 63.5", "111.0 ± 127.1",
                                     "0.917", "1.100 |"]
    assert "  T=8: -3.0 (-28.4 to +22.4)  per seed -5.0 -1.0" in lines
    assert "| untied | 1 | - | 99.0 | - | - | - |" in lines
    assert json.loads((tmp_path / "s.json").read_text())["scse"]["1"] == {
        "2": 120.0, "8": 110.0, "32": 121.0}


def test_a_seed_in_two_studies_is_one_line(tmp_path):
    a = _study(tmp_path, "a", {("scse", 0): {4: 100.0}})
    b = _study(tmp_path, "b", {("scse", 0): {4: 101.0}})
    done = _run(a, b, "--name", "heldout")
    assert done.returncode == 1
    assert done.stderr.strip() == (f"score_validation: scse seed 0 is in {a}/scse/scse-seed0 and "
                                   f"in {b}/scse/scse-seed0: name one of the studies only")


@pytest.mark.parametrize("args, message", [
    (["--name", "wikitext"], "no run of these studies has eval/wikitext.json (give --data to "
                             "evaluate it)"),
    (["--name", "heldout", "--pair", "scse", "nope"], "--pair nope: no such variant (have: scse)"),
])
def test_nothing_to_score_is_one_line(tmp_path, args, message):
    a = _study(tmp_path, "a", {("scse", 0): {4: 100.0}})
    done = _run(a, *args)
    assert done.returncode == 1
    assert done.stderr.strip() == f"score_validation: {message}"
