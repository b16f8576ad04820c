"""Pathology flags of one study run, from its training log (metrics.jsonl) and its evaluation:
plateau, loop inactive, anchor fixed point (a description, never excluded), divergence and
non-finite. What each means, with FlagThresholds' values: docs/evaluation.md, docs/studies.md.
The plateau's reference is the unigram entropy of up to `max_tokens` training tokens (eos
included); ln V when the shards cannot be read, an upper bound that still catches a uniform model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from scse_dist.model.transitions import transition_for
from scse_dist.study.collect import StudyRun, finite
from scse_dist.task_registry import TASKS


@dataclass(frozen=True)
class FlagThresholds:
    plateau_margin: float = 0.1
    flat_rel: float = 0.02
    collapse_ratio: float = 0.1
    motion_rel: float = 0.01
    divergence_margin: float = 1.0
    outlier_margin: float = 0.3


@dataclass(frozen=True)
class Flag:
    name: str  # plateau | loop inactive | anchor fixed point | divergence | non-finite
    detail: str

    @property
    def excludes(self) -> bool:
        """Whether exclude_flagged drops the run: a pathology, not the anchor fixed point."""
        return self.name != "anchor fixed point"


@dataclass(frozen=True)
class UnigramEntropy:
    nats: float
    source: str  # how it was obtained, for the report


@functools.cache
def unigram_entropy(data_path: str, vocab_size: int, max_tokens: int = 2_000_000) -> UnigramEntropy:
    """-sum p ln p of the token frequencies of the training shards at `data_path` (cached)."""
    from scse_dist.data.index import iter_samples, resolve_split

    counts = np.zeros(vocab_size, dtype=np.int64)
    try:
        _, index, _, urls = resolve_split(str(data_path), "train")
        for tokens in (t for url in urls
                       for _, t, _ in iter_samples(url, index["eos_id"], index["vocab_size"])):
            counts += np.bincount(tokens.astype(np.int64), minlength=vocab_size)[:vocab_size]
            if counts.sum() >= max_tokens:
                break
    except Exception as exc:  # JSONL corpus, missing or remote shards: fall back, and say so
        return UnigramEntropy(math.log(vocab_size), f"ln V = ln {vocab_size} (training shards at "
                              f"{data_path} not readable: {type(exc).__name__})")
    total = int(counts.sum())
    if total == 0:
        return UnigramEntropy(math.log(vocab_size),
                              f"ln V = ln {vocab_size} ({data_path}: no tokens)")
    p = counts[counts > 0] / total
    return UnigramEntropy(float(-(p * np.log(p)).sum()),
                          f"unigram entropy of {total:,} training tokens of {data_path}")


def headline_by_depth(run: StudyRun) -> tuple[Optional[str], dict[int, float]]:
    """(task and metric, {depth: value}) of the first quality task with results, its headline."""
    for task in (t for t in TASKS.values() if not t.diagnostic):
        if task.name in run.results:
            return f"{task.name} {task.headline}", {
                d: v for d, r in run.results[task.name].items()
                if (v := finite(r.get(task.headline))) is not None}
    return None, {}


def flat_in_t(run: StudyRun, th: FlagThresholds) -> Optional[str]:
    """'heldout ppl flat for T >= 2 (spread 0.41%)' when a looped model's headline metric barely
    moves with T, else None."""
    if run.config is not None and not transition_for(run.config.model).loops:
        return None
    name, values = headline_by_depth(run)
    deep = [v for d, v in sorted(values.items()) if d >= 2]
    if len(deep) < 2:
        return None
    spread = (max(deep) - min(deep)) / max(abs(min(deep)), 1e-12)
    return f"{name} flat for T >= 2 (spread {100 * spread:.2f}%)" if spread < th.flat_rel else None


def _final_loss(run: StudyRun) -> Optional[float]:
    losses = [r.get("loss") for r in run.metrics if "loss" in r]
    return finite(losses[-1]) if losses else None


def above_peers(run: StudyRun, peers: list[StudyRun], th: FlagThresholds) -> Optional[str]:
    """Why the final loss is more than outlier_margin above every peer's, or None."""
    final = _final_loss(run)
    others = [x for x in (_final_loss(p) for p in peers) if x is not None]
    if final is None or not others or final <= max(others) + th.outlier_margin:
        return None
    return (f"final loss {final:.3f}, {final - max(others):.2f} nats above its variant's other "
            f"seeds ({min(others):.3f}-{max(others):.3f})")


def _collapsed_in_training(run: StudyRun, th: FlagThresholds) -> Optional[str]:
    """Why the training log's last loop diagnostics show a loop fallen onto its anchor, or None."""
    rows = [r for r in run.metrics if finite(r.get("diag/D_kept")) is not None]
    if not rows or rows[-1]["diag/D_kept"] >= th.collapse_ratio:
        return None
    last = rows[-1]
    return (f"in training |D_T|/|D_0| was {last['diag/D_kept']:.3g} at step {last.get('step')} "
            "(diag/D_kept)")


def _deviation(run: StudyRun) -> dict[int, float]:
    return {d: v for d, r in (run.results.get("diagnose") or {}).items()
            if (v := finite(r.get("deviation_norm"))) is not None}


def _fell(deviation: dict[int, float], th: FlagThresholds) -> Optional[tuple[float, float]]:
    """(deviation at the deepest T, the largest) if the first < collapse_ratio x the second."""
    if not deviation:
        return None
    deepest, largest = deviation[max(deviation)], max(deviation.values())
    return (deepest, largest) if largest > 0 and deepest < th.collapse_ratio * largest else None


def _loop_inactive(run: StudyRun, th: FlagThresholds, outlier: Optional[str]) -> Optional[Flag]:
    training = _collapsed_in_training(run, th)
    flat = flat_in_t(run, th)
    if flat is None:  # an unevaluated run has only its training diagnostics to go on
        unevaluated = not headline_by_depth(run)[1]
        return Flag("loop inactive", training) if training and unevaluated else None
    diag = run.results.get("diagnose")
    if not diag:
        confirm = "; ".join(x for x in (training, outlier) if x)
        return Flag("loop inactive", f"{flat}; {confirm or 'no diagnose results to confirm'}")
    deviation = _deviation(run)
    motion2 = finite(diag.get(2, {}).get("motion_norm"))
    why = []
    if fell := _fell(deviation, th):
        why.append(f"deviation_norm fell to {fell[0]:.3g} from {fell[1]:.3g}")
    if motion2 is not None and deviation.get(1) and motion2 < th.motion_rel * deviation[1]:
        why.append(f"motion_norm at T=2 is {motion2:.3g} against deviation_norm {deviation[1]:.3g}")
    why += [x for x in (training, outlier) if x]
    return Flag("loop inactive", f"{flat}; {'; '.join(why)}") if why else None


def _anchor_fixed_point(run: StudyRun, th: FlagThresholds) -> Optional[Flag]:
    if run.config is not None and not transition_for(run.config.model).has_anchor:
        return None  # the others' deviation is from their source, which they leave by design
    deviation = _deviation(run)
    if not (fell := _fell(deviation, th)):
        return None
    return Flag("anchor fixed point",
                f"deviation_norm falls to {fell[0]:.3g} at T={max(deviation)} from {fell[1]:.3g}: "
                "the state ends at or near its anchor, where the core's update is zero")


def run_flags(run: StudyRun, entropy: Optional[UnigramEntropy],
              th: FlagThresholds = FlagThresholds(),
              peers: Optional[list[StudyRun]] = None) -> list[Flag]:
    """Every pathology flag `run` raises; `peers`: the other finished seeds of its variant."""
    flags: list[Flag] = []
    flat = flat_in_t(run, th)
    outlier = above_peers(run, peers or [], th) if flat else None
    losses: list[Any] = [r.get("loss") for r in run.metrics if "loss" in r]  # JSON values
    if losses:
        final = losses[-1]
        good = [x for x in losses if finite(x) is not None]
        if finite(final) is None:
            flags.append(Flag("divergence", f"final training loss is {final}"))
        elif good and final > min(good) + th.divergence_margin:
            flags.append(Flag("divergence", f"final loss {final:.3f} is above its minimum "
                                            f"{min(good):.3f} by more than {th.divergence_margin}"))
        elif entropy is not None and final > entropy.nats - th.plateau_margin:
            flags.append(Flag("plateau", f"final loss {final:.3f} within {th.plateau_margin} "
                                         f"nats of the unigram entropy {entropy.nats:.3f} (or "
                                         "above it)"))
        elif outlier:
            flags.append(Flag("plateau", f"{flat} at {outlier}"))
    skipped = max((int(r.get("skipped_steps") or 0) for r in run.metrics), default=0)
    if skipped:
        flags.append(Flag("non-finite",
                          f"{skipped} step(s) skipped for a non-finite loss or gradient"))
    inactive = _loop_inactive(run, th, outlier)
    settled = None if inactive else _anchor_fixed_point(run, th)
    flags += [f for f in (inactive, settled) if f]
    return flags
