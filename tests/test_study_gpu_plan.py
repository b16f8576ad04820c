"""`scse-study --dry-run` of the GPU study (configs/studies/gpt2-small-decisive.yaml): every cell,
seed and stage, the evaluation files by name, and the planner's GPU-hours (`scse-train --plan`
per run) at 40% and 25% MFU on 8 and 64 GPUs, checked against the training FLOPs counted
independently (scse_dist.model.flops over the depth distribution); the cells train at equal
FLOPs, and the search seed is none of the confirmation seeds."""

from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT
from scse_dist.cli_errors import EXIT_NO_INPUT
from scse_dist.study.cli import main as study_main
from scse_dist.study.runs import expand, run_config
from scse_dist.study.spec import load_spec
from scse_dist.train.plan import GPUS, peak_flops

SPEC = REPO_ROOT / "configs" / "studies" / "gpt2-small-decisive.yaml"
PLANNED = re.compile(r"^planned GPU-hours: ([\d.,]+) \(sweep ([\d.,]+), final ([\d.,]+)\) on "
                     r"(\d+) x H100 \((\d+) node\(s\) of 8\); the longest run ([\d.]+) h .*, at "
                     r"(\d+)% MFU", re.M)
CELLS = {"scse-preln-adamw", "scse-preln-muon", "scse-deeploop-adamw", "additive-preln-adamw",
         "additive-preln-muon", "additive-deeploop-muon", "untied-muon"}


def training_flops(cfg) -> float:
    """A run's training FLOPs: the depth distribution's mean FLOPs per token (not the planner's
    sampled draws) x steps x tokens a step."""
    from scse_dist.model import flops_per_token

    d = cfg.train.depth
    if d.kind == "fixed":
        per_token = flops_per_token(cfg.model, cfg.model.depth, cfg.data.seq_len)
    else:
        per_token = sum(flops_per_token(cfg.model, t, cfg.data.seq_len, d.backprop_steps)
                        for t in range(d.min, d.max + 1)) / (d.max - d.min + 1)
    return per_token * cfg.train.max_steps * cfg.train.batch.global_batch_tokens


@pytest.fixture(scope="module")
def spec():
    return load_spec(SPEC)


def test_the_cells_train_at_equal_flops_and_the_search_seed_is_apart(spec):
    final = expand(spec, {v: 1e-3 for v in spec.variants}, ("final",))
    flops = {r.variant: training_flops(run_config(spec, r)) for r in final}
    assert set(flops) == CELLS
    mean = sum(flops.values()) / len(flops)
    assert all(abs(f / mean - 1) < 0.01 for f in flops.values()), flops
    assert mean == pytest.approx(1.379e19, rel=0.001)
    untied = run_config(spec, next(r for r in final if r.variant == "untied-muon"))
    assert untied.model.n_prelude + untied.model.n_core * untied.model.depth + \
        untied.model.n_coda == 12  # a non-looped 12-block model
    assert spec.lr is not None and spec.lr.extend_edges
    assert spec.lr.seed not in spec.seeds and len(spec.seeds) == 3
    assert {r.seed for r in expand(spec, stages=("sweep",))} == {spec.lr.seed}
    assert spec.evals.depths == [1, 2, 4, 8, 16, 32, 48, 64]
    primary = spec.preregistration["primary"]
    assert (primary["pair"], primary["task"], primary["metric"], primary["depth"]) == \
        (["scse-deeploop-adamw", "additive-preln-muon"], "wikitext", "word_ppl", 48)


def test_the_gpu_study_dry_run_lists_its_runs_files_and_planned_gpu_hours(spec, capsys):
    # its data is not here: the dry run still lists and plans, and exits 66 naming the inputs
    assert study_main([str(SPEC), "--dry-run"]) == EXIT_NO_INPUT
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line.split()[-1:] == ["new"]]
    assert len(rows) == 42  # 7 cells x (3 sweep rates + 3 seeds)
    assert {r[0] for r in rows} == CELLS
    assert {r[1] for r in rows if r[3] == "sweep"} == {"0"}
    assert {r[1] for r in rows if r[3] == "final"} == {"1", "2", "3"}
    assert "stages: sweep (21 runs at seed 0) -> rates chosen on validation.path -> final (21 " \
        f"runs at seeds 1, 2, 3) -> validation ({REPO_ROOT}/data/eval-gpu/wiki.valid.raw, each " \
        "final run) -> report (the pre-registration first)" in out  # against the spec's dir
    for name in ("wiki.valid.raw", "wiki.test.raw", "lambada_test.jsonl"):
        assert f"data/eval-gpu/{name}" in out
    assert out.count("edge rule (lr.extend_edges)") == 1
    plans = {(int(m[4]), int(m[7])): m for m in PLANNED.finditer(out)}
    assert set(plans) == {(8, 40), (8, 25), (64, 40), (64, 25)}, out
    rate = 0.40 * peak_flops(GPUS["h100"])
    counted = {stage: sum(training_flops(run_config(spec, r))
                          for r in expand(spec, stages=(stage,))) / rate / 3600
               for stage in ("sweep", "final")}
    for (world, mfu), found in plans.items():
        total, sweep, final = (float(found[i].replace(",", "")) for i in (1, 2, 3))
        assert int(found[5]) == world // 8
        assert total == pytest.approx(sweep + final, abs=0.11)
        # the plan sums each step's sampled depth; the expectation differs by the draws (~1%)
        assert final == pytest.approx(counted["final"] * 0.40 / (mfu / 100), rel=0.02)
        assert sweep == pytest.approx(counted["sweep"] * 0.40 / (mfu / 100), rel=0.05)
        # equal training FLOPs: each final run costs the same, so the longest is a 21st of the
        # final stage's hours (7 cells x 3 seeds), over the world
        assert float(found[6]) == pytest.approx(final / 21 / world, rel=0.03, abs=0.06)
