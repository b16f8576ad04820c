"""`scse-study --dry-run` of a GPU study prints its planned GPU-hours (the planner of
`scse-train --plan` per run), checked on configs/studies/gpt2-small-decisive.yaml against the
training FLOPs counted independently (scse_dist.model.flops over the depth distribution)."""

from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT
from scse_dist.cli_errors import EXIT_NO_INPUT
from scse_dist.study.cli import main as study_main
from scse_dist.study.runs import expand, run_config
from scse_dist.study.spec import load_spec
from scse_dist.train.plan import GPUS, Assumptions, peak_flops

SPEC = REPO_ROOT / "configs" / "studies" / "gpt2-small-decisive.yaml"
PLANNED = re.compile(r"^planned GPU-hours: ([\d.,]+) \(sweep ([\d.,]+), final ([\d.,]+)\) on "
                     r"(\d+) x H100 \((\d+) node\(s\) of 8\); the longest run ([\d.]+) h", re.M)


def expected_gpu_hours(spec, stage: str) -> float:
    """Training FLOPs of the stage's runs over the sustained FLOP rate of one GPU (40% of an
    H100's peak): the depth distribution's mean FLOPs per token, not the sampled draws."""
    from scse_dist.model import flops_per_token

    rate = Assumptions().mfu * peak_flops(GPUS["h100"])
    total = 0.0
    for run in expand(spec, stages=(stage,)):
        cfg = run_config(spec, run)
        d = cfg.train.depth
        per_token = sum(flops_per_token(cfg.model, t, cfg.data.seq_len, d.backprop_steps)
                        for t in range(d.min, d.max + 1)) / (d.max - d.min + 1)
        total += per_token * cfg.train.max_steps * cfg.train.batch.global_batch_tokens
    return total / rate / 3600


@pytest.mark.parametrize("world, overrides", [
    (8, []), (64, ["resources.nodes=8", "overrides.train.batch.micro_batch_size=8"])])
def test_the_gpu_study_dry_run_lists_its_runs_and_their_planned_gpu_hours(world, overrides,
                                                                          capsys):
    # its data is not here: the dry run still lists and plans, and exits 66 naming the inputs
    assert study_main([str(SPEC), *overrides, "--dry-run"]) == EXIT_NO_INPUT
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line.split()[-1:] == ["new"]]
    assert len(rows) == 18  # 3 variants x (3 sweep rates + 3 seeds)
    assert sum(r[3] == "sweep" for r in rows) == 9 and sum(r[3] == "final" for r in rows) == 9
    found = PLANNED.search(out)
    assert found, out
    total, sweep, final = (float(found[i].replace(",", "")) for i in (1, 2, 3))
    assert (int(found[4]), int(found[5])) == (world, world // 8)
    assert total == pytest.approx(sweep + final, abs=0.11)
    spec = load_spec(SPEC, overrides)
    # the plan sums each step's sampled depth; the expectation differs by the draws (~1%)
    assert final == pytest.approx(expected_gpu_hours(spec, "final"), rel=0.02)
    assert sweep == pytest.approx(expected_gpu_hours(spec, "sweep"), rel=0.05)
    # equal training FLOPs: the three variants' final runs cost the same GPU-hours, so the
    # longest run is a ninth of the final stage's hours (3 variants x 3 seeds), over the world
    assert float(found[6]) == pytest.approx(final / 9 / world, rel=0.02, abs=0.06)
