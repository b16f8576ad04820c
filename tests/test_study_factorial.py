"""The factorial's statistics (scse_dist.study.stats.factorial_effects) and its report section
(scse_dist.study.factorial), on synthetic numbers whose effects are known exactly."""

import itertools
import json
import math

import pytest
import yaml

from scse_dist.config import config_from_dict, save_config
from scse_dist.eval.results import write_results
from scse_dist.study.report import write_study_report
from scse_dist.study.spec import SpecError, parse_spec
from scse_dist.study.stats import factorial_effects, t_quantile

FACTORS = ["recurrence", "residual", "optimizer"]
SEED_SHIFT = [20.0, -15.0, 7.0]  # a seed's luck, shared by every cell: pairing removes it
Z = [-1.0, 0.0, 1.0]  # per-seed noise of mean 0, scaled per cell: the estimates stay exact


def truth(a, b, c):
    """Additive effects, an a x b interaction and an a x b x c one (levels 0 and 1)."""
    return 150.0 + 8 * a + 5 * b - 3 * c + 4 * a * b + 2 * a * b * c


# level 1 minus level 0, averaged over the rest; interactions as differences of differences
EXPECTED = {"recurrence": 10.5, "residual": 7.5, "optimizer": -2.5,
            "recurrence x residual": 5.0, "recurrence x optimizer": 1.0,
            "residual x optimizer": 1.0, "recurrence x residual x optimizer": 2.0}


def noise_scale(cell):
    return 3.0 if cell == (1, 1, 1) else 1.0  # only the (1, 1, 1) cell's noise survives contrasts


def synthetic(seeds_of=lambda cell: [0, 1, 2]):
    return {cell: {s: truth(*cell) + SEED_SHIFT[s % 3] + noise_scale(cell) * Z[s % 3]
                   for s in seeds_of(cell)}
            for cell in itertools.product((0, 1), repeat=3)}


def test_effects_paired_by_seed_are_exact_and_their_intervals_cover_and_exclude_as_designed():
    effects = factorial_effects(synthetic(), FACTORS)
    assert list(effects) == list(EXPECTED)
    for name, value in EXPECTED.items():
        e = effects[name]
        assert e.paired and e.n == 3
        assert e.mean == pytest.approx(value, abs=1e-12)
        # the per-seed contrast's sd is 2 * coefficient of the (1,1,1) cell: 2 / 2^(3 - order)
        sd = 2.0 / 2 ** (3 - len(name.split(" x ")))
        half = t_quantile(0.975, 2) * sd / math.sqrt(3)
        assert (e.low, e.high) == (pytest.approx(value - half), pytest.approx(value + half))
    # half-widths 1.24 (main), 2.48 (two-way), 4.97 (three-way): the seed shift of +-20 is gone
    assert {n for n, e in effects.items() if e.excludes_zero()} == {
        "recurrence", "residual", "optimizer", "recurrence x residual"}


def test_without_shared_seeds_the_effects_take_welchs_interval_over_cell_means():
    # the (1, 1, 1) cell ran seeds 3-5: no seed is in every cell, so nothing pairs
    effects = factorial_effects(synthetic(lambda c: [3, 4, 5] if c == (1, 1, 1) else [0, 1, 2]),
                                FACTORS)
    paired = factorial_effects(synthetic(), FACTORS)
    for name, value in EXPECTED.items():
        e = effects[name]
        assert not e.paired and e.n == 3
        assert e.mean == pytest.approx(value, abs=1e-12)
        assert e.low < value < e.high
        assert e.high - e.low > 3 * (paired[name].high - paired[name].low)  # the seed shift stays
    # one seed per cell: an estimate, no interval
    single = factorial_effects(synthetic(lambda c: [0]), FACTORS)
    assert single["recurrence"].low is None and single["recurrence"].n == 1


def test_a_cell_without_values_is_refused():
    cells = synthetic()
    del cells[(0, 1, 0)]
    with pytest.raises(ValueError, match=r"no value in cell \(0, 1, 0\)"):
        factorial_effects(cells, FACTORS)


LEVELS = {"model.recurrence": ["additive", "scse"], "model.residual": ["preln", "deeploop"],
          "train.optimizer.kind": ["muon", "torch_adamw"]}
DEPTHS = [1, 4, 8, 32]


def write_cell_run(study, cell, seed):
    values = dict(zip(LEVELS, (levels[i] for levels, i in zip(LEVELS.values(), cell))))
    variant = "-".join(str(v) for v in values.values())
    run_dir = study / variant / f"seed{seed}"
    cfg = config_from_dict({
        "name": f"{variant}-seed{seed}", "output_dir": str(run_dir.parent),
        "model": {"recurrence": values["model.recurrence"], "residual": values["model.residual"],
                  "vocab_size": 256, "d_model": 32, "n_heads": 2, "max_seq_len": 32},
        "data": {"path": str(study / "no-shards"), "seq_len": 32},
        "train": {"optimizer": values["train.optimizer.kind"], "max_steps": 30, "seed": seed},
        "wandb": {"enabled": False}})
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    ppl = truth(*cell) + SEED_SHIFT[seed] + noise_scale(cell) * Z[seed]
    write_results(run_dir / "eval" / "heldout.json", "heldout", f"{cfg.name}@step-30", cfg,
                  [{"depth": t, "loss": math.log(ppl + t), "ppl": ppl + t, "tokens": 100}
                   for t in DEPTHS])
    return {"variant": variant, "seed": seed, "lr": 1e-3, "stage": "final",
            "run_dir": str(run_dir.relative_to(study)), "config": str(run_dir / "config.yaml")}


def test_the_report_prints_the_factorial_at_each_depth(tmp_path):
    study = tmp_path / "factorial"
    entries = [write_cell_run(study, cell, seed) for seed in range(3)
               for cell in itertools.product((0, 1), repeat=3)]
    (study / "runs.json").write_text(json.dumps(entries))
    (study / "study.yaml").write_text(yaml.safe_dump({
        "name": "factorial", "pairs": [], "report": {"factorial": {"factors": LEVELS}}}))
    report = write_study_report(study, wandb_mode="disabled").read_text()
    assert "## Factorial: model.recurrence (additive → scse) × model.residual (preln → " \
           "deeploop) × train.optimizer.kind (muon → torch_adamw)" in report
    assert "| recurrence x residual | +5 [+2.516, +7.484]* | +5 [+2.516, +7.484]* | " in report
    assert "| recurrence x residual x optimizer | +2 [-2.968, +6.968] |" in report
    found = json.loads((study / "report" / "aggregate.json").read_text())["factorial"]
    assert set(found["heldout/ppl"]) == {"1", "4", "8", "32"}
    for depth in DEPTHS:  # a depth offset common to every cell leaves every effect alone
        for name, value in EXPECTED.items():
            assert found["heldout/ppl"][str(depth)][name]["mean"] == pytest.approx(value)


def test_two_variants_in_one_cell_are_named_not_averaged(tmp_path):
    study = tmp_path / "two"
    entries = [write_cell_run(study, cell, seed) for seed in range(2)
               for cell in itertools.product((0, 1), repeat=3)]
    extra = dict(entries[0], variant="additive-preln-muon-lr2", run_dir=entries[0]["run_dir"])
    (study / "runs.json").write_text(json.dumps(entries + [extra]))
    (study / "study.yaml").write_text(yaml.safe_dump({
        "name": "two", "pairs": [], "report": {"factorial": {"factors": LEVELS}}}))
    report = write_study_report(study, wandb_mode="disabled").read_text()
    assert "not a factorial: cell (0, 0, 0) holds 2 variants (additive-preln-muon, " \
           "additive-preln-muon-lr2)" in report


@pytest.mark.parametrize("factorial, message", [
    ({"factors": {"model.recurrence": ["scse"]}}, "report.factorial.factors: 2 to 4"),
    ({"factors": {"model.recurrence": ["scse", "scse"], "model.residual": ["preln", "deeploop"]}},
     r"report.factorial.factors.model.recurrence: a dotted run-config field with two different"),
    ({"factors": LEVELS, "depths": [4, "8"]}, "report.factorial.depths: a non-empty list"),
    ({"factor": LEVELS}, "report.factorial: expected"),
])
def test_a_bad_factorial_in_the_spec_is_one_line_naming_the_field(tmp_path, factorial, message):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"vocab_size": 256, "d_model": 32, "n_heads": 2,
                                              "max_seq_len": 32}, "data": {"seq_len": 32}}))
    with pytest.raises(SpecError, match=message):
        parse_spec({"name": "s", "base": "base.yaml", "variants": {"scse": {}},
                    "report": {"factorial": factorial}}, str(tmp_path / "spec.yaml"))
