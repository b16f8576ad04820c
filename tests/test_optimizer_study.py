"""benchmarks/optimizer_study.py: the tokens a candidate optimizer needs to reach its baseline's
final validation loss, seed by seed, interpolated between checkpoints."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO_ROOT

spec = importlib.util.spec_from_file_location("optimizer_study",
                                              REPO_ROOT / "benchmarks" / "optimizer_study.py")
optimizer_study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(optimizer_study)


def test_steps_to_reach_interpolates_between_the_checkpoints_around_the_crossing():
    curve = {50: 7.0, 100: 6.0, 150: 5.0, 200: 5.5}
    assert optimizer_study.steps_to_reach(curve, 5.5) == pytest.approx(125.0)
    assert optimizer_study.steps_to_reach(curve, 7.5) == 50.0  # already below at the first one
    assert optimizer_study.steps_to_reach(curve, 6.0) == 100.0
    assert optimizer_study.steps_to_reach(curve, 4.9) is None


def test_compare_pairs_seeds_and_counts_tokens_saved():
    base = {0: {100: 6.0, 200: 5.0}, 1: {100: 6.2, 200: 5.2}}
    cand = {0: {100: 5.0, 200: 4.5}, 1: {100: 5.7, 200: 4.7}}  # seed 1 crosses 5.2 at step 150
    out = optimizer_study.compare({"m": cand, "a": base}, "m", "a", {"m": 10, "a": 10})
    assert [r["candidate_tokens_to_reach"] for r in out["seeds"]] == [1000.0, 1500.0]
    assert [r["tokens_saved"] for r in out["seeds"]] == [1000.0, 500.0]
    assert out["all_reached"] and out["tokens_saved"]["mean"] == 750.0
    assert out["token_ratio"] == [0.5, 0.75]
    assert out["final_loss_difference"]["mean"] == pytest.approx(-0.5)
    never = optimizer_study.compare({"m": {0: {100: 6.5, 200: 6.1}}, "a": base}, "m", "a",
                                    {"m": 10, "a": 10})
    assert not never["all_reached"] and "tokens_saved" not in never
    assert never["seeds"][0]["candidate_tokens_to_reach"] is None
