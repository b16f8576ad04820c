"""The pieces of a study spec the GPU study needs, each on its own: `validation:` (the task it
adds, the sweep's text), `preregistration:` (checked, and its rule applied), `costing:`, the
record merged over pieces (runs.json) and the edge rule of the rate choice (lr.extend_edges)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scse_dist.study.plan import LR_CHOICE_NAME, RUNS_NAME, StudyError, choose_lrs, merged_runs
from scse_dist.study.prereg import decision, markdown
from scse_dist.study.runs import expand
from scse_dist.study.spec import SpecError, parse_spec
from scse_dist.study.stats import t_interval


def spec_of(tmp_path, tiny_config, **fields):
    values = {"name": "s", "out": str(tmp_path / "out"), "base": tiny_config(tmp_path),
              "variants": {"a": {"overrides": {}}, "b": {"overrides": {}}}, "seeds": [1, 2],
              "validation": {"path": "valid.txt", "depth": 2}, **fields}
    return parse_spec(values, str(tmp_path / "spec.yaml"))


def test_validation_is_a_task_of_the_final_runs_and_the_sweeps_text(tmp_path, tiny_config):
    spec = spec_of(tmp_path, tiny_config, lr={"values": [1e-3, 2e-3]})
    assert spec.evals.tasks == ["heldout", "validation"]
    assert spec.evals.data == {"validation": "valid.txt"}
    assert spec.lr is not None and spec.lr.validation == "valid.txt"  # lr.validation defaults
    assert not spec.lr.extend_edges


PRIMARY = {"pair": ["a", "b"], "task": "wikitext", "metric": "word_ppl", "depth": 4}


@pytest.mark.parametrize("body, message", [
    ({"secondary": []}, "preregistration: expected {primary: ..."),
    ({"primary": {**PRIMARY, "pair": ["a", "c"]}}, "preregistration.primary.pair: two variants"),
    ({"primary": {**PRIMARY, "task": "diagnose"}}, "preregistration.primary.task: one of heldout"),
    ({"primary": {**PRIMARY, "metric": "acc"}},
     "preregistration.primary.metric: 'acc' is not a metric of wikitext"),
    ({"primary": PRIMARY, "secondary": [{**PRIMARY, "depth": 0}]},
     "preregistration.secondary[0].depth: a loop depth >= 1, got 0"),
    ({"primary": {"pair": ["a", "b"]}}, "preregistration.primary: expected {pair: [A, B], task"),
])
def test_a_bad_preregistration_names_its_field(tmp_path, tiny_config, body, message):
    with pytest.raises(SpecError, match="^" + str(tmp_path / "spec.yaml")) as err:
        spec_of(tmp_path, tiny_config, preregistration=body)
    assert message in str(err.value), str(err.value)


def test_the_rule_decides_only_when_the_interval_excludes_zero():
    ppl = {"pair": ["a", "b"], "task": "wikitext", "metric": "word_ppl", "depth": 48}
    acc = {"pair": ["a", "b"], "task": "lambada", "metric": "accuracy", "depth": 48}
    lower = t_interval([-3.0, -2.0, -2.5])  # a - b below zero
    assert decision(ppl, lower) == "a is better (a - b excludes 0 at 3 seeds)"
    assert decision(acc, lower) == "b is better (a - b excludes 0 at 3 seeds)"  # higher is better
    assert decision(ppl, t_interval([-3.0, 1.0, -2.5])) == \
        "not resolved at 3 seeds (the interval contains 0)"
    assert decision(ppl, t_interval([-3.0])) == \
        "not resolved: 1 seed in common (an interval needs 2)"
    assert decision(ppl, None).startswith("no result")
    lines = markdown({"primary": ppl, "secondary": [acc], "note": "why"},
                     {("a", "b", "wikitext", "word_ppl", 48): lower})
    assert lines[0] == "## Pre-registration (declared in the spec before the runs)"
    assert lines[8].startswith("| **primary** | a - b | wikitext word_ppl | 48 | -2.5 [")
    assert lines[9] == "| secondary | a - b | lambada accuracy | 48 |  | no result: no seed " \
        "has both runs evaluated at this depth |"


@pytest.mark.parametrize("body, message", [
    ({"gpus": [0]}, "costing.gpus: a list of GPU counts >= 1"),
    ({"mfu": [1.5]}, "costing.mfu: a non-empty list of fractions in (0, 1]"),
    ({"gpu": [8]}, "costing: expected {gpus: [8, 64], mfu: [0.4, 0.25]}"),
])
def test_a_bad_costing_names_its_field(tmp_path, tiny_config, body, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(")):
        spec_of(tmp_path, tiny_config, costing=body)


def test_runs_json_keeps_every_piece_in_the_specs_order(tmp_path, tiny_config):
    spec = spec_of(tmp_path, tiny_config)
    a1, b1, a2, b2 = [r.record() for r in expand(spec)]  # seed-major: a1 b1 a2 b2
    spec.study_dir.mkdir(parents=True)
    gone = {**a1, "run_dir": str(spec.study_dir / "old/old-seed0"), "variant": "old"}
    (spec.study_dir / RUNS_NAME).write_text(json.dumps([gone, b2, {**a1, "lr": 0.5}]))
    merged = merged_runs(spec, [a1, a2])
    # the newest entry of a run wins; the spec's order; a run it no longer names stays, last
    assert merged == [a1, a2, b2, gone]
    assert [r["run_dir"] for r in merged] == [a1["run_dir"], a2["run_dir"], b2["run_dir"],
                                             gone["run_dir"]]
    assert merged[0]["lr"] is None  # not the old entry's 0.5


def scored_sweep(spec, variant: str, losses: dict[float, float]) -> None:
    """Sweep runs of `variant` with their validation score already written."""
    for run in expand(spec, stages=("sweep",)):
        if run.variant == variant and run.lr in losses:
            out = Path(run.run_dir) / "eval"
            out.mkdir(parents=True, exist_ok=True)
            (out / "validation.json").write_text(json.dumps(
                {"task": "heldout", "results": [{"depth": 2, "loss": losses[run.lr]}]}))


def test_the_edge_rule_stops_at_an_edge_and_a_piece_merges_its_choice(tmp_path, tiny_config):
    spec = spec_of(tmp_path, tiny_config, lr={"values": [1e-3, 2e-3, 4e-3], "extend_edges": True})
    scored_sweep(spec, "a", {1e-3: 5.0, 2e-3: 4.0, 4e-3: 4.5})
    scored_sweep(spec, "b", {1e-3: 5.0, 2e-3: 4.5, 4e-3: 4.0})
    spec.only = ["a"]
    assert choose_lrs(spec) == {"a": 2e-3}  # interior: chosen
    spec.only = ["b"]
    with pytest.raises(StudyError) as err:
        choose_lrs(spec)
    assert str(err.value) == ("b: its best rate 0.004 is at the edge of its grid (0.001, 0.002, "
                              "0.004); the edge rule (lr.extend_edges): add 0.008 to its "
                              "train.optimizer.lr grid (the variant's lr.values) and rerun")
    assert json.loads((spec.study_dir / LR_CHOICE_NAME).read_text()).keys() == {"a"}
    spec.lr.extend_edges = False
    assert choose_lrs(spec) == {"a": 2e-3, "b": 4e-3}  # merged with a's, in the spec's order
