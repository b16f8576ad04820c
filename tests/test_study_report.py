"""Study report on synthetic study dirs written with the real writers (config.yaml, metrics.jsonl,
eval/*.json): means, spreads and t intervals over seeds, paired verdicts, pathology flags,
missing runs, exclusion, plots."""

import json
import math

import pytest
import yaml

from scse_dist.config import config_from_dict, save_config
from scse_dist.eval.results import write_results
from scse_dist.study.compare import verdict
from scse_dist.study.report import write_study_report
from scse_dist.study.report_cli import main as scse_report_main
from scse_dist.study.stats import Interval, t_interval, t_quantile
from scse_dist.train.metrics import MetricsLogger

DEPTHS = (1, 2, 4, 8)
VOCAB = 256  # no shards at the configs' data.path: the plateau reference is ln 256 = 5.545


def write_run(study, variant, seed, *, recurrence=None, heldout=None, lambada=None,
              diagnose=None, losses=(6.0, 4.0, 3.5), skipped=0, stage="final", evaluated=True,
              started=True, subdir=None, logged=None):
    """One run dir as the trainer and scse-eval leave it; returns its runs.json entry."""
    run_dir = study / variant / (subdir or f"seed{seed}")
    entry = {"variant": variant, "seed": seed, "lr": 1e-3, "stage": stage,
             "run_dir": str(run_dir.relative_to(study)), "config": str(run_dir / "config.yaml"),
             "overrides": []}
    if not started:
        return entry
    cfg = config_from_dict({
        "name": f"{variant}-seed{seed}", "output_dir": str(study / variant),
        "model": {"recurrence": recurrence or variant, "vocab_size": VOCAB, "d_model": 32,
                  "n_heads": 2, "max_seq_len": 32, "depth": 4},
        "data": {"path": str(study / "no-shards"), "seq_len": 32},
        "train": {"max_steps": 30, "seed": seed}, "wandb": {"enabled": False}})
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    log = MetricsLogger(str(run_dir), True, cfg.wandb, cfg.name, {})
    for i, loss in enumerate(losses):
        log.log({"step": 10 * (i + 1), "loss": loss, "lr": 1e-3, "depth": 4, "tokens_per_s": 1.0,
                 "step_time_s": 0.1, "skipped_steps": skipped if i == len(losses) - 1 else 0,
                 **(logged[i] if logged else {})})
    log.close()
    if not evaluated:
        return entry
    label = f"{cfg.name}@step-30"
    if heldout:
        write_results(run_dir / "eval" / "heldout.json", "heldout", label, cfg,
                      [{"depth": t, "loss": math.log(v), "ppl": v, "tokens": 100}
                       for t, v in heldout.items()])
    if lambada:
        write_results(run_dir / "eval" / "lambada.json", "lambada", label, cfg,
                      [{"depth": t, "accuracy": a, "loss": 3.0, "ppl": 20.0}
                       for t, a in lambada.items()])
    if diagnose:
        write_results(run_dir / "eval" / "diagnose.json", "diagnose", label, cfg,
                      [{"depth": t, "bias_norm": b, "effective_bias_norm": 0.0,
                        "deviation_norm": dev, "motion_norm": mot, "batches": 1}
                       for t, (dev, mot, b) in diagnose.items()])
    return entry


def write_study(study, entries, **spec):
    (study / "study.yaml").write_text(yaml.safe_dump({"name": study.name, **spec}))
    (study / "runs.json").write_text(json.dumps(entries))
    return study


def numbers(study):
    return json.loads((study / "report" / "aggregate.json").read_text())


HEALTHY_DIAG = {t: (10.0 + t, 1.0 / t if t else 0.0, 2.0) for t in DEPTHS}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """additive, scse (better everywhere), looped (better at T=1, worse at T=8) and untied (one
    point, unresolved), 3 seeds each; lambada accuracy for additive and scse. Reported once
    (scse-report --study), without wandb."""
    study = tmp_path_factory.mktemp("studies") / "cmp"
    base = {1: 50.0, 2: 40.0, 4: 30.0, 8: 32.0}
    looped_shift = {1: [-3.0, -3.1, -3.2], 2: [1.0, -1.0, 0.5], 4: [2.0, -2.0, 1.0],
                    8: [4.0, 4.1, 4.2]}
    entries = []
    for s in range(3):
        add = {t: v + s for t, v in base.items()}
        entries.append(write_run(study, "additive", s, heldout=add,
                                 lambada={t: 0.2 for t in DEPTHS}, diagnose=HEALTHY_DIAG))
        entries.append(write_run(study, "scse", s,
                                 heldout={t: v - 5 - 0.1 * s for t, v in add.items()},
                                 lambada={t: 0.25 + 0.01 * s for t in DEPTHS},
                                 diagnose=HEALTHY_DIAG))
        entries.append(write_run(study, "looped", s,
                                 heldout={t: v + looped_shift[t][s] for t, v in add.items()}))
        entries.append(write_run(study, "untied", s, heldout={4: add[4] + [3.0, -3.0, 1.0][s]}))
    (study / "lr_choice.json").write_text(json.dumps(
        {"scse": {"lr": 1e-3, "scores": {"0.001": 30.5, "0.003": 31.25}},
         "additive": {"lr": 3e-3, "scores": {"0.001": 33.0, "0.003": 32.0, "0.01": 32.5}}}))
    write_study(study, entries, variants={"additive": {}, "scse": {}, "looped": {}, "untied": {}},
                seeds=[0, 1, 2])
    assert scse_report_main(["--study", str(study), "--wandb", "disabled"]) == 0
    return study


def test_t_quantile_matches_the_tables():
    assert t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-4)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile(0.95, 10) == pytest.approx(1.8125, abs=1e-4)
    assert t_quantile(0.025, 3) == pytest.approx(-3.1824, abs=1e-4)
    assert t_quantile(0.975, 10_000) == pytest.approx(1.9602, abs=1e-4)  # -> the normal's 1.96


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms(p):
    """df 1 is Cauchy's tan(pi (p - 1/2)); df 2 is (2p - 1) / sqrt(2p(1 - p))."""
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-12)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-12)


@pytest.mark.parametrize("p, df, before", [
    (0.975, 2.7, 3.3921483831736623), (0.975, 5.5, 2.501858617589278),
    (0.9, 7.3, 1.40892231774842), (0.995, 3, 5.840909309734343), (0.975, 30, 2.042272456300452)])
def test_t_quantile_keeps_the_former_values(p, df, before):
    """What the hand-written incomplete beta gave (Welch's df need not be whole): scipy's agree."""
    assert t_quantile(p, df) == pytest.approx(before, abs=1e-9)
    with pytest.raises(ValueError, match="t_quantile: need 0 < p < 1"):
        t_quantile(1.0, df)


def test_t_interval_of_three_seeds_and_of_one():
    iv = t_interval([1.0, 2.0, 3.0])
    assert (iv.n, iv.mean, iv.std) == (3, 2.0, 1.0)
    assert iv.low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-4)
    assert iv.high == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-4)
    assert t_interval([5.0]) == Interval(1, 5.0, None, None, None)


def test_aggregate_has_the_mean_std_and_t_interval_per_variant_and_depth(comparison):
    agg = numbers(comparison)["aggregate"]
    additive = agg["additive/heldout/ppl"]
    assert sorted(additive, key=int) == ["1", "2", "4", "8"]
    assert additive["4"]["mean"] == pytest.approx(31.0) and \
        additive["4"]["std"] == pytest.approx(1.0)
    assert additive["4"]["low"] == pytest.approx(31 - 4.3027 / math.sqrt(3), abs=1e-4)
    assert agg["untied/heldout/ppl"]["4"]["mean"] == pytest.approx(31 + 1 / 3)
    assert list(agg["untied/heldout/ppl"]) == ["4"]
    report = (comparison / "report" / "report.md").read_text()
    assert "Student-t intervals over seeds" in report and "no bootstrap" in report
    assert "| additive | 51 ± 2.48 (sd 1, n=3) | 41 ± 2.48 (sd 1, n=3) |" in report
    # the lr section: a choice at the grid's edge is marked, one inside it is not
    assert "| scse | 0.001 (grid edge: lowest) | 0.001: 30.5, 0.003: 31.25 |" in report
    assert "| additive | 0.003 | 0.001: 33, 0.003: 32, 0.01: 32.5 |" in report


def test_paired_verdicts_follow_the_metric_direction(comparison):
    paired = numbers(comparison)["paired"]
    assert paired["scse - additive/heldout/ppl"]["verdict"] == "better at all depths"
    diff = paired["scse - additive/heldout/ppl"]["depths"]["2"]
    assert diff["mean"] == pytest.approx(-5.1) and diff["std"] == pytest.approx(0.1)
    assert paired["scse - additive/lambada/accuracy"]["verdict"] == "better at all depths"  # higher
    assert paired["looped - additive/heldout/ppl"]["verdict"] == \
        "better at depths 1; worse at depths 8"
    assert paired["untied - additive/heldout/ppl"]["verdict"] == "not resolved at 3 seeds"
    report = (comparison / "report" / "report.md").read_text()
    assert "| looped - additive |" in report and \
        "looped better at depths 1; worse at depths 8 |" in report


def test_verdict_cells():
    sure_down, unsure = Interval(3, -2.0, 0.1, -2.3, -1.7), Interval(3, 0.5, 2.0, -4.0, 5.0)
    up = Interval(3, 2.0, 0.1, 1.7, 2.3)
    assert verdict({1: sure_down, 2: sure_down}, higher_is_better=False) == "better at all depths"
    assert verdict({1: sure_down, 2: sure_down}, higher_is_better=True) == "worse at all depths"
    assert verdict({1: unsure, 4: sure_down, 8: sure_down}, False) == "better at depths 4, 8"
    assert verdict({1: unsure, 2: up}, False) == "worse at depths 2"
    assert verdict({1: unsure}, False) == "not resolved at 3 seeds"
    assert verdict({1: Interval(1, -9.0, None, None, None)}, False) == "not resolved at 1 seed"


def test_extrapolation_ratio_past_the_training_depth(comparison):
    report = (comparison / "report" / "report.md").read_text()
    # additive trained at T=4 (fixed depth): mean ppl 33 at T=8 over 31 at T=4
    assert f"| additive heldout ppl (trained to T=4), ref T=4 | {33 / 31:.3f} |" in report


def flagged_study(tmp_path, exclude):
    study = tmp_path / ("excl" if exclude else "incl")
    good = {t: 30.0 - t for t in DEPTHS}
    entries = [write_run(study, "additive", s, heldout={t: v + s for t, v in good.items()},
                         diagnose=HEALTHY_DIAG) for s in range(3)]
    entries += [
        write_run(study, "scse", 0, heldout=good, diagnose=HEALTHY_DIAG),
        # the loop fell onto its anchor: flat ppl from T=2, deviation 15 -> 0.7
        write_run(study, "scse", 1, heldout={1: 300.0, 2: 266.0, 4: 266.0, 8: 266.1},
                  diagnose={1: (15.0, 3.0, 1.0), 2: (5.0, 2.0, 1.0), 4: (1.0, 0.1, 1.0),
                            8: (0.7, 0.01, 1.0)}),
        write_run(study, "scse", 2, heldout={t: v + 1 for t, v in good.items()},
                  diagnose=HEALTHY_DIAG),
        # ln 256 - 0.1 < 5.6
        write_run(study, "untied", 0, heldout={4: 900.0}, losses=(6.9, 6.0, 5.6)),
        write_run(study, "looped", 0, heldout=good, skipped=2),
        write_run(study, "looped", 1, heldout=good, losses=(6.0, 3.0, 4.5)),
        # a sweep run at the final runs' rate and seed: its flag is its own, not seed 0's
        write_run(study, "scse", 0, heldout=good, losses=(6.9, 6.0, 5.6), stage="sweep",
                  subdir="lr0.001/seed0"),
    ]
    return write_study(study, entries, pairs=[["scse", "additive"]], exclude_flagged=exclude)


def test_flags_are_raised_listed_and_counted_by_default(tmp_path):
    study = flagged_study(tmp_path, exclude=False)
    write_study_report(study, wandb_mode="disabled")
    flags = {run: [f["name"] for f in fl] for run, fl in numbers(study)["flags"].items()}
    assert flags == {"scse/seed1 lr=0.001": ["loop inactive"], "untied/seed0 lr=0.001": ["plateau"],
                     "looped/seed0 lr=0.001": ["non-finite"],
                     "looped/seed1 lr=0.001": ["divergence"],
                     "scse/seed0 lr=0.001 sweep": ["plateau"]}
    report = (study / "report" / "report.md").read_text()
    assert "included in (and marked) the aggregate" in report
    assert "| scse/seed1 lr=0.001 | final | loop inactive | heldout ppl flat for T >= 2" in report
    assert "| scse/seed0 lr=0.001 sweep | sweep | plateau |" in report
    assert "| scse/seed0 lr=0.001 | final |" not in report  # the final seed 0 is healthy
    assert "deviation_norm fell to 0.7 from 15" in report
    assert "ln V = ln 256" in report and "5.545 nats" in report
    assert numbers(study)["aggregate"]["scse/heldout/ppl"]["4"]["n"] == 3
    assert "| scse (1 flagged) | 119.7 ± 388 (sd 156, n=3) |" in report  # counted, and marked
    assert numbers(study)["excluded"] == []


def test_flagged_runs_leave_the_aggregate_when_the_spec_says_so(tmp_path):
    study = flagged_study(tmp_path, exclude=True)
    write_study_report(study, wandb_mode="disabled")
    nums = numbers(study)
    assert sorted(nums["excluded"]) == ["looped/seed0 lr=0.001", "looped/seed1 lr=0.001",
                                        "scse/seed1 lr=0.001", "untied/seed0 lr=0.001"]
    scse = nums["aggregate"]["scse/heldout/ppl"]["4"]
    assert scse["n"] == 2 and scse["mean"] == pytest.approx(26.5)
    assert "untied/heldout/ppl" not in nums["aggregate"]
    assert "excluded from the aggregate" in (study / "report" / "report.md").read_text()


def write_validation(study, entry, ppl):
    """scse-study's LR sweep score: eval/validation.json, task heldout on the validation data."""
    cfg = config_from_dict({"name": "v", "model": {"vocab_size": VOCAB}})
    write_results(study / entry["run_dir"] / "eval" / "validation.json", "heldout", "v", cfg,
                  [{"depth": 4, "loss": math.log(ppl), "ppl": ppl, "tokens": 10}])


def test_missing_and_failed_runs_are_named_and_the_rest_aggregated(tmp_path):
    study = tmp_path / "partial"
    entries = [write_run(study, "scse", s, heldout={1: 10.0 + s, 2: 8.0 + s}) for s in range(2)]
    write_validation(study, entries[0], 1e6)  # not a test result: never aggregated
    for e in entries:  # as scse-study wrote it from another cwd: resolved inside the study dir
        e["run_dir"] = f"elsewhere/{study.name}/{e['run_dir']}"
    entries.append(write_run(study, "scse", 2, evaluated=False, losses=(6.0, 5.0)))
    entries.append(write_run(study, "scse", 3, started=False))
    sweep = write_run(study, "scse", 0, stage="sweep", evaluated=False, subdir="lr0.001/seed0")
    write_validation(study, sweep, 40.0)  # a finished sweep run: scored, no test results
    write_study(study, entries + [sweep])
    assert scse_report_main(["--study", str(study), "--wandb", "disabled"]) == 0
    report = (study / "report" / "report.md").read_text()
    assert "5 runs: 3 finished, 2 missing" in report and \
        "2 final-stage runs in the aggregate" in report
    assert "- scse/seed2 lr=0.001 (final, " in report
    assert "no evaluation results (training stopped at step 20 of 30)" in report
    assert "- scse/seed3 lr=0.001 (final, " in report and "no run dir (never started)" in report
    agg = numbers(study)["aggregate"]["scse/heldout/ppl"]
    assert agg["1"]["n"] == 2 and agg["1"]["mean"] == pytest.approx(10.5)


def test_plots_are_pngs_and_the_flops_axis_counts_scse_extra_call(comparison):
    import matplotlib.image

    from scse_dist.model.flops import flops_per_token
    from scse_dist.study.collect import load_study
    from scse_dist.study.report import StudyReport

    for name in ("frontier_depth.png", "frontier_flops.png", "diagnose.png"):
        image = matplotlib.image.imread(str(comparison / "report" / name))
        assert image.shape[0] > 100 and image[..., :3].std() > 0.01, name
        assert f"]({name})" in (comparison / "report" / "report.md").read_text()
    report = StudyReport(load_study(comparison))
    series = report.frontier_series("flops")["heldout ppl"]
    scse_cfg = report.config_of("scse").model
    assert [x for x, _ in series["scse"]] == [flops_per_token(scse_cfg, t, 32) for t in DEPTHS]
    additive_x = [x for x, _ in series["additive"]]
    assert all(s > a for (s, _), a in zip(series["scse"], additive_x))  # T+1 core calls
    assert len(series["untied"]) == 1  # an untied model is a point


def test_the_study_is_logged_to_wandb_as_one_group(comparison, tmp_path, monkeypatch):
    import scse_dist.eval.results as eval_results

    calls = []
    monkeypatch.setattr(eval_results, "log_to_wandb", lambda *a, **k: calls.append((a, k)))
    # every run config disables wandb: by default the report logs nothing either
    assert write_study_report(comparison, tmp_path / "quiet") == tmp_path / "quiet" / "report.md"
    assert calls == [] and not (tmp_path / "quiet" / "wandb").exists()
    assert write_study_report(comparison, tmp_path / "w", "offline") == tmp_path / "w" / "report.md"
    (results, cfg), kwargs = calls[0][0], calls[0][1]
    assert len(calls) == 1 and kwargs["group"] == "cmp" and cfg.mode == "offline"
    means = {(r["_label"], r["task"]): {x["depth"]: x[next(k for k in x if k != "depth")]
                                        for x in r["results"]} for r in results}
    assert means[("additive", "heldout")][4] == pytest.approx(31.0)
    assert set(kwargs["images"]) == {"frontier vs loop depth", "frontier vs FLOPs",
                                     "loop diagnostics"}


def test_unigram_entropy_is_counted_from_the_training_shards(tiny_data):
    import numpy as np

    from scse_dist.data.index import iter_samples, resolve_split
    from scse_dist.study.flags import unigram_entropy

    _, index, _, urls = resolve_split(tiny_data["path"], "train")
    tokens = np.concatenate([t for u in urls
                             for _, t, _ in iter_samples(u, index["eos_id"], index["vocab_size"])])
    p = np.bincount(tokens) / len(tokens)
    expected = -(p[p > 0] * np.log(p[p > 0])).sum()
    got = unigram_entropy(tiny_data["path"], index["vocab_size"])
    assert got.nats == pytest.approx(expected) and 0 < got.nats < math.log(index["vocab_size"])
    assert "training tokens" in got.source


def test_scse_report_needs_runs_or_a_study_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        scse_report_main([])
    assert exc.value.code == 2 and "give run dirs, or --study STUDY_DIR" in capsys.readouterr().err
    assert scse_report_main(["--study", str(tmp_path)]) == 66
    assert "no runs.json (not a study dir" in capsys.readouterr().err


def test_every_metric_of_a_task_is_reported_and_equal_differences_say_no_difference(tmp_path):
    """LAMBADA accuracy 0 for every run (as at small sizes): the paired verdict says 'no
    difference'; LAMBADA ppl and WikiText's three metrics are in the report by default, and the
    spec's report.metrics picks others."""
    study = tmp_path / "metrics"
    entries = []
    for s in range(3):
        for variant, shift in (("additive", 0.0), ("scse", -40.0)):
            run = write_run(study, variant, s,
                            heldout={1: 60.0 + shift / 4 + s, 2: 50.0 + shift / 4 + s})
            rows = [{"depth": t, "accuracy": 0.0, "loss": math.log(700 + shift + s),
                     "ppl": 700.0 + shift + s, "examples": 50} for t in (1, 2)]
            wiki = [{"depth": t, "loss": 5.0 + shift / 100, "ppl": math.exp(5.0 + shift / 100),
                     "word_ppl": 400.0 + shift + s, "bits_per_byte": 2.0 + shift / 100 + 0.01 * s}
                    for t in (1, 2)]
            cfg = config_from_dict({"name": "x", "model": {"vocab_size": VOCAB}})
            eval_dir = study / run["run_dir"] / "eval"
            write_results(eval_dir / "lambada.json", "lambada", "x", cfg, rows)
            write_results(eval_dir / "wikitext.json", "wikitext", "x", cfg, wiki)
            entries.append(run)
    write_study(study, entries)
    write_study_report(study)
    nums = numbers(study)
    assert {k.split("/", 1)[1] for k in nums["aggregate"]} == {
        "heldout/ppl", "lambada/ppl", "lambada/accuracy", "wikitext/ppl", "wikitext/word_ppl",
        "wikitext/bits_per_byte"}
    paired = nums["paired"]
    assert paired["scse - additive/lambada/accuracy"]["verdict"] == \
        "no difference (equal at every depth in all 3 seeds)"
    assert paired["scse - additive/lambada/ppl"]["verdict"] == "better at all depths"
    assert paired["scse - additive/wikitext/bits_per_byte"]["verdict"] == "better at all depths"
    report = (study / "report" / "report.md").read_text()
    assert "## lambada ppl (lower is better)" in report and \
        "## lambada accuracy (higher is better)" in report
    assert "| scse - additive | 0 ± 0 (sd 0, n=3) | 0 ± 0 (sd 0, n=3) | scse no difference" in \
        report
    assert "## wikitext bits_per_byte (lower is better)" in report

    write_study(study, entries, report={"metrics": {"lambada": ["loss"], "heldout": ["loss"]}})
    write_study_report(study)
    chosen = {k.split("/", 1)[1] for k in numbers(study)["aggregate"]}
    assert chosen == {"heldout/loss", "lambada/loss", "wikitext/ppl", "wikitext/word_ppl",
                      "wikitext/bits_per_byte"}


def test_a_seed_flat_in_t_far_above_its_variants_other_seeds_is_flagged(tmp_path):
    """additive-deeploop in the issue: one seed flat in T at loss 6.09 while the others reached
    5.3-5.6, below the entropy: here 4.09 against 3.3-3.6 (the plateau reference is 5.545)."""
    study = tmp_path / "outlier"
    entries = [write_run(study, "additive", s, losses=(6.0, 4.0, final),
                         heldout={1: 40.0 + s, 2: 30.0 + s, 4: 25.0 + s, 8: 24.0 + s})
               for s, final in ((0, 3.3), (1, 3.6))]
    entries.append(write_run(study, "additive", 2, losses=(6.0, 4.5, 4.09),
                             heldout={1: 70.0, 2: 60.0, 4: 60.1, 8: 60.05}))
    # flat too, but diagnose shows a moving loop and it is not above its peer: no flag
    entries.append(write_run(study, "scse", 0, losses=(6.0, 3.5), heldout={2: 30.0, 4: 30.1},
                             diagnose=HEALTHY_DIAG))
    entries.append(write_run(study, "scse", 1, losses=(6.0, 3.6), heldout={2: 31.0, 4: 40.0}))
    write_study(study, entries)
    write_study_report(study)
    flags = numbers(study)["flags"]
    assert list(flags) == ["additive/seed2 lr=0.001"]
    details = {f["name"]: f["detail"] for f in flags["additive/seed2 lr=0.001"]}
    tail = "final loss 4.090, 0.49 nats above its variant's other seeds (3.300-3.600)"
    assert details == {
        "plateau": f"heldout ppl flat for T >= 2 (spread 0.17%) at {tail}",
        "loop inactive": f"heldout ppl flat for T >= 2 (spread 0.17%); {tail}"}


def test_the_training_logs_loop_diagnostics_are_drawn_per_run_and_a_collapse_is_dashed(tmp_path):
    """A healthy and a collapsing seed (issue 17's pattern: |D_T|/|D_0| falls to 0.003 while R/rho
    grows to 2): the collapsing run is flagged loop inactive, and the plot has both runs' series."""
    import matplotlib.image

    from scse_dist.study.collect import load_study
    from scse_dist.study.report import StudyReport

    def diag(kept, ratio, gain):
        return [{"diag/D_kept": k, "diag/anchor_over_scale": r, "diag/loop_gain": g}
                for k, r, g in zip(kept, ratio, gain)]

    study = tmp_path / "collapse"
    entries = [
        write_run(study, "scse", 0, heldout={1: 40.0, 2: 30.0, 4: 25.0, 8: 24.0},
                  logged=diag((1.0, 1.1, 1.2), (1.0, 1.05, 1.1), (0.01, 0.2, 0.3))),
        write_run(study, "scse", 1, heldout={1: 50.0, 2: 41.0, 4: 41.05, 8: 41.02},
                  logged=diag((1.0, 0.05, 0.003), (1.0, 1.6, 2.0), (0.01, 0.004, 0.0001))),
        write_run(study, "additive", 0, heldout={1: 40.0, 2: 30.0, 4: 26.0, 8: 25.0})]
    write_study(study, entries)
    write_study_report(study)
    report = StudyReport(load_study(study))
    assert report.collapsed() == {"scse/seed1 lr=0.001"}
    series = report.training_diagnostics_series()
    assert list(series) == ["scse"]  # additive logged no loop diagnostics
    assert series["scse"]["scse/seed1 lr=0.001"]["diag/D_kept"] == \
        [(10, 1.0), (20, 0.05), (30, 0.003)]
    assert series["scse"]["scse/seed0 lr=0.001"]["diag/anchor_over_scale"][-1] == (30, 1.1)
    image = matplotlib.image.imread(str(study / "report" / "training_diagnostics.png"))
    assert image.shape[0] > 100 and image[..., :3].std() > 0.01
    text = (study / "report" / "report.md").read_text()
    assert "](training_diagnostics.png)" in text
    # per run: heldout ppl at each T, its ratio at T=8 over the training depth 4, the last logged
    # diagnostics and the flag
    assert "| scse/seed1 lr=0.001 | 50 | 41 | 41.05 | 41.02 | 0.999 | 0.003 | 2 | 0.0001 " \
           "| loop inactive |" in text
    assert "| scse/seed0 lr=0.001 | 40 | 30 | 25 | 24 | 0.960 | 1.2 | 1.1 | 0.3 |  |" in text
    assert "| additive/seed0 lr=0.001 | 40 | 30 | 26 | 25 | 0.962 |  |  |  |  |" in text


def test_an_evaluation_under_another_name_does_not_replace_the_tasks_result(tmp_path):
    """score_validation writes RUN/eval/validation-owt.json with task "heldout" (another text):
    the report's heldout numbers stay the run's heldout.json, whatever the files' order."""
    study = tmp_path / "named"
    entries = []
    for s in range(2):
        run = write_run(study, "scse", s, heldout={1: 30.0 + s, 2: 20.0 + s})
        cfg = config_from_dict({"name": "x", "model": {"vocab_size": VOCAB}})
        write_results(study / run["run_dir"] / "eval" / "validation-owt.json", "heldout", "x",
                      cfg, [{"depth": t, "loss": 5.0, "ppl": 99.0, "tokens": 10} for t in (1, 2)])
        entries.append(run)
    write_study(study, entries)
    write_study_report(study)
    means = numbers(study)["aggregate"]["scse/heldout/ppl"]
    assert (means["1"]["mean"], means["2"]["mean"]) == (30.5, 20.5)
