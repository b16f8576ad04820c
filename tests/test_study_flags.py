"""The loop-inactive flag reads the training log's loop diagnostics (diag/D_kept)."""

from __future__ import annotations

from pathlib import Path

from scse_dist.study.collect import StudyRun
from scse_dist.study.flags import FlagThresholds, run_flags

FLAT = {"heldout": {t: {"depth": t, "ppl": 250.0, "loss": 5.52} for t in (1, 2, 4, 8)}}
MOVING = {"heldout": {t: {"depth": t, "ppl": 300.0 - 10 * t, "loss": 5.6} for t in (1, 2, 4, 8)}}


def run_of(results: dict, kept: list[float]) -> StudyRun:
    metrics = [{"step": 10 * (i + 1), "loss": 5.0, "diag/D_kept": k} for i, k in enumerate(kept)]
    return StudyRun("scse", 1, 2e-3, "final", Path("x"), results=results, metrics=metrics)


def flags(run: StudyRun) -> list[tuple[str, str]]:
    return [(f.name, f.detail) for f in run_flags(run, None, FlagThresholds())]


def test_flat_metric_confirmed_by_the_training_diagnostics() -> None:
    assert flags(run_of(FLAT, [1.0, 0.5, 0.013])) == [(
        "loop inactive", "heldout ppl flat for T >= 2 (spread 0.00%); in training |D_T|/|D_0| "
        "was 0.013 at step 30 (diag/D_kept)")]


def test_a_loop_that_kept_its_deviation_is_not_confirmed() -> None:
    assert flags(run_of(FLAT, [1.0, 0.05, 0.8])) == [(
        "loop inactive", "heldout ppl flat for T >= 2 (spread 0.00%); no diagnose results to "
        "confirm")]


def test_training_diagnostics_alone_flag_an_unevaluated_run_only() -> None:
    assert flags(run_of({}, [0.02])) == [
        ("loop inactive", "in training |D_T|/|D_0| was 0.02 at step 10 (diag/D_kept)")]
    assert flags(run_of(MOVING, [0.02])) == []  # the metric moves with T: the loop does work
