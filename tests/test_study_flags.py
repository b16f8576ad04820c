"""The loop-inactive flag reads the training log's loop diagnostics (diag/D_kept); the anchor
fixed-point flag reads how the deviation falls with T in the diagnose results."""

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


def diagnose(deviation: dict[int, float]) -> dict[int, dict]:
    return {t: {"depth": t, "deviation_norm": v, "motion_norm": v / 2}
            for t, v in deviation.items()}


def test_a_loop_that_settles_on_its_anchor_is_flagged_once() -> None:
    settling = {**MOVING, "diagnose": diagnose({1: 10.6, 2: 4.6, 4: 1.08, 8: 0.1})}
    assert flags(run_of(settling, [0.9])) == [(
        "anchor fixed point", "deviation_norm falls to 0.1 at T=8 from 10.6: the state ends at or "
        "near its anchor, where the core's update is zero")]
    # one that keeps a deviation of its own (a fixed point off the anchor) is not
    kept = {**MOVING, "diagnose": diagnose({1: 15.1, 2: 13.4, 4: 12.0, 8: 11.3})}
    assert flags(run_of(kept, [0.9])) == []
    # flat in T as well: loop inactive says it, not both
    flat = {**FLAT, "diagnose": diagnose({1: 10.6, 8: 0.1})}
    assert [name for name, _ in flags(run_of(flat, [0.9]))] == ["loop inactive"]
