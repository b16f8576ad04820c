"""scse-study: a spec expands to the runs it names (variants x axes x seeds, LR sweep), bad specs
fail naming the field, --dry-run prints the table, --local trains and evaluates every run, picks
each variant's learning rate on the validation corpus, and a rerun repeats nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, tiny_documents
from scse_dist.resources import Resources
from scse_dist.study.runs import check_runs, expand
from scse_dist.study.spec import SpecError, load_spec, parse_spec


def study_spec(base: str, out: str, **fields) -> dict:
    spec = {"name": "s", "out": out, "base": base,
            "variants": {"scse": {"overrides": {"model.recurrence": "scse"}},
                         "additive": {"overrides": {"model.recurrence": "additive"}},
                         "looped": {"overrides": {"model.recurrence": "looped"}}},
            "seeds": [0, 1, 2],
            "axes": {"model.residual": {"values": ["preln", "deeploop"],
                                        "variants": ["scse", "additive"]}},
            "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    spec.update(fields)
    return spec


def write_spec(path: Path, spec: dict) -> str:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def study(*args: str, cwd=REPO_ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scse_dist.study.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env)


def test_expansion_counts_names_and_resolved_configs(tmp_path, tiny_config):
    base = tiny_config(tmp_path)
    spec = parse_spec(study_spec(base, str(tmp_path / "out"),
                                 lr={"values": [1e-3, "3e-3"], "validation": "v.txt", "steps": 7}),
                      str(tmp_path / "spec.yaml"))
    # scse and additive x 2 residuals, looped alone: 5 variants
    assert list(spec.variants) == ["scse-preln", "scse-deeploop", "additive-preln",
                                   "additive-deeploop", "looped"]
    assert spec.pairs == [("scse-preln", "additive-preln"), ("scse-deeploop", "additive-deeploop"),
                          ("looped", "additive-preln")]
    runs = expand(spec)
    sweep = [r for r in runs if r.stage == "sweep"]
    final = [r for r in runs if r.stage == "final"]
    assert (len(sweep), len(final)) == (5 * 2, 5 * 3)
    assert sweep[1].run_dir == str(tmp_path / "out/s/scse-preln/scse-preln-lr0.003-seed0")
    assert sweep[1].overrides == {"model.recurrence": "scse", "model.residual": "preln",
                                  "train.optimizer.lr": 3e-3, "train.seed": 0, "train.max_steps": 7}
    assert final[0].run_dir == str(tmp_path / "out/s/scse-preln/scse-preln-seed0") and \
        final[0].lr is None
    # seed-major: every variant's seed 0, then every variant's seed 1, ...
    assert [(r.variant, r.seed) for r in final[:6]] == \
        [(v, 0) for v in spec.variants] + [("scse-preln", 1)]
    chosen = expand(spec, {v: 0.5 for v in spec.variants}, ("final",))
    assert {r.lr for r in chosen} == {0.5} and chosen[6].overrides["train.seed"] == 1

    from scse_dist.study.runs import run_config
    cfg = run_config(spec, next(r for r in chosen if (r.variant, r.seed) == ("scse-deeploop", 1)))
    assert (cfg.name, cfg.output_dir) == \
        ("scse-deeploop-seed1", str(tmp_path / "out/s/scse-deeploop"))
    assert (cfg.model.recurrence, cfg.model.residual, cfg.train.seed, cfg.train.optimizer.lr) == \
        ("scse", "deeploop", 1, 0.5)
    assert (cfg.eval.depths, cfg.eval.tasks, cfg.eval.after_train) == ([1, 2], ["heldout"], False)


def test_a_spec_of_before_sets_its_flat_train_names_over_the_base(tmp_path, tiny_config):
    """A spec's overrides in the old flat names (train.lr, train.warmup_steps, train.optimizer:
    muon) set those fields over a base that uses the new ones, as they did over a flat base."""
    from scse_dist.study.runs import run_config

    variants = {"old": {"overrides": {"train.lr": 7e-3, "train.warmup_steps": 3,
                                      "train.optimizer": "muon", "train.muon_lr": 0.01}},
                "new": {"overrides": {"train.optimizer.lr": 7e-3}}}
    spec = parse_spec(study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={},
                                 variants=variants, seeds=[0]), str(tmp_path / "spec.yaml"))
    t = {r.variant: run_config(spec, r).train for r in expand(spec)}
    assert (t["old"].optimizer.lr, t["old"].schedule.warmup_steps) == (7e-3, 3)
    assert (t["old"].optimizer.kind, t["old"].optimizer.muon_lr) == ("muon", 0.01)
    assert (t["new"].optimizer.lr, t["new"].schedule.warmup_steps) == (7e-3, 2)  # the base's 2


def test_a_variant_sweeps_its_own_rate_field_over_its_own_grid(tmp_path, tiny_config):
    """Muon's rate is train.optimizer.muon_lr: a variant's lr: {key, values} sweeps that field over
    its own grid, and its final runs set the chosen value there, leaving train.optimizer.lr as
    configured."""
    from scse_dist.study.runs import run_config

    variants = {"adamw": {"overrides": {}},
                "muon": {"overrides": {"train.optimizer": "muon"},
                         "lr": {"key": "train.optimizer.muon_lr", "values": ["1e-2", 0.04]}}}
    spec = parse_spec(study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={},
                                 variants=variants, seeds=[0, 1],
                                 lr={"values": [1e-3, 3e-3], "validation": "v.txt"}),
                      str(tmp_path / "spec.yaml"))
    assert (spec.rate_key("adamw"), spec.rate_key("muon")) == ("train.optimizer.lr",
                                                                "train.optimizer.muon_lr")
    sweep = [r for r in expand(spec) if r.stage == "sweep"]
    assert [(r.variant, r.lr) for r in sweep] == [("adamw", 1e-3), ("adamw", 3e-3),
                                                  ("muon", 0.01), ("muon", 0.04)]
    assert sweep[3].run_dir.endswith("muon/muon-lr0.04-seed0")
    muon = run_config(spec, sweep[3])
    assert (muon.train.optimizer.kind, muon.train.optimizer.muon_lr) == ("muon", 0.04)
    assert run_config(spec, sweep[0]).train.optimizer.lr == 1e-3
    assert muon.train.optimizer.lr == 3e-3  # the base config's: Muon's AdamW half
    final = expand(spec, {"adamw": 3e-3, "muon": 0.01}, ("final",))
    cfgs = {(r.variant, r.seed): run_config(spec, r) for r in final}
    assert (cfgs["muon", 1].train.optimizer.muon_lr, cfgs["muon", 1].train.seed) == (0.01, 1)
    assert cfgs["adamw", 1].train.optimizer.lr == 3e-3


def test_variant_major_order_relative_out_and_resources(tmp_path, tiny_config):
    spec = parse_spec(study_spec(tiny_config(tmp_path), "studies", order="variant-major",
                                 resources={"cpus_per_task": 2, "time_min": 30}),
                      str(tmp_path / "specs" / "spec.yaml"))
    final = expand(spec, stages=("final",))
    assert [(r.variant, r.seed) for r in final[:4]] == [("scse-preln", 0), ("scse-preln", 1),
                                                       ("scse-preln", 2), ("scse-deeploop", 0)]
    # out: relative to the spec file, like base:
    assert spec.study_dir == tmp_path / "specs" / "studies" / "s"
    assert spec.resources == Resources(cpus_per_task=2, time_min=30)
    typed = load_spec(write_spec(tmp_path / "spec.yaml", study_spec(tiny_config(tmp_path), "x")),
                      ["out=here"])
    assert typed.study_dir == Path.cwd() / "here" / "s"  # typed on the command line: the cwd's


def test_a_spec_extends_another_and_overrides_are_typed_yamls(tmp_path, tiny_config):
    """A spec file is read by scse_dist.typed_yaml: `extends:` overlays another spec (mappings
    merged; `base:` and `out:` relative to the file that sets them), and command-line overrides
    are key.sub=value, with the keys of `overrides:` mappings dotted run-config fields."""
    base = tiny_config(tmp_path)
    (tmp_path / "specs").mkdir()
    parent = study_spec("../" + Path(base).name, "../out", axes={},
                        overrides={"train.max_steps": 7, "data.seq_len": 16})
    write_spec(tmp_path / "specs" / "parent.yaml", parent)
    (tmp_path / "more").mkdir()
    child = write_spec(tmp_path / "more" / "child.yaml",
                       {"extends": "../specs/parent.yaml", "name": "c", "seeds": [5],
                        "overrides": {"train.max_steps": 9},
                        "variants": {"looped": {"overrides": {"model.depth": 3}}}})
    spec = load_spec(child)
    assert Path(spec.base).resolve() == Path(base).resolve()  # the parent's base, from its dir
    assert spec.study_dir.resolve() == tmp_path / "out" / "c"
    assert (spec.name, spec.seeds) == ("c", [5])
    assert spec.overrides == {"train.max_steps": 9, "data.seq_len": 16}
    assert spec.variants["looped"] == {"model.recurrence": "looped", "model.depth": 3}
    assert list(spec.variants) == ["scse", "additive", "looped"]

    typed = load_spec(child, ["overrides.train.max_steps=11",
                              "variants.scse.overrides.model.depth=5",
                              "lr.values=[1e-3]", "lr.validation=v.txt", "seeds=[1,2]"])
    assert typed.overrides == {"train.max_steps": 11, "data.seq_len": 16}
    assert typed.variants["scse"] == {"model.recurrence": "scse", "model.depth": 5}
    assert typed.lr.values == [1e-3] and typed.lr.validation == "v.txt" and typed.seeds == [1, 2]

    with pytest.raises(SpecError, match=r"override 'seeds': expected key.sub=value"):
        load_spec(child, ["seeds"])
    loop = write_spec(tmp_path / "loop.yaml", {"extends": "loop.yaml"})
    with pytest.raises(SpecError, match=r"study spec '.*loop.yaml': `extends` chain loops back"):
        load_spec(loop)
    with pytest.raises(SpecError, match=r"study spec '.*nope.yaml' does not exist"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("name: [\n")
    with pytest.raises(SpecError, match=r"study spec .*bad.yaml:2: not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_runs_json_keeps_one_entry_a_run_however_its_path_was_written(tmp_path, tiny_config,
                                                                     monkeypatch):
    """A submission typed in the repo names the spec relatively, a stage job by its full path:
    their run dirs differ in form, not in run, and runs.json and the report count each run once
    (a rehearsal's report read '56 runs' for 28 before)."""
    from scse_dist.study.collect import load_study
    from scse_dist.study.plan import RUNS_NAME, write_study

    monkeypatch.chdir(tmp_path)
    write_spec(tmp_path / "spec.yaml", study_spec(tiny_config(tmp_path), "out", axes={}))
    relative, absolute = load_spec("spec.yaml"), load_spec(tmp_path / "spec.yaml")
    assert relative.study_dir == Path("out/s") and absolute.study_dir == tmp_path / "out" / "s"
    write_study(relative, "final")
    runs = write_study(absolute, "final")
    entries = json.loads((absolute.study_dir / RUNS_NAME).read_text())
    assert len(runs) == len(entries) == 9  # 3 variants x 3 seeds, each once, the newest form
    assert all(Path(e["run_dir"]).is_absolute() for e in entries)
    # a runs.json written before run_key, listing runs in both forms, loads each run once
    twice = [dict(e, run_dir=str(Path(e["run_dir"]).relative_to(tmp_path))) for e in entries]
    (absolute.study_dir / RUNS_NAME).write_text(json.dumps(twice + entries))
    assert len(load_study(absolute.study_dir).runs) == 9


def test_a_study_read_back_pairs_by_the_specs_rule(tmp_path, tiny_config):
    """One default-pairs rule (study.spec.default_pairs): a spec without pairs and a study dir
    whose study.yaml has none pair the same way; an empty list is no pairs in both."""
    from scse_dist.study.collect import Study

    base = tiny_config(tmp_path)
    plain = parse_spec(study_spec(base, str(tmp_path / "out"), axes={}), str(tmp_path / "s.yaml"))
    assert plain.pairs == [("scse", "additive"), ("looped", "additive")]

    def read_back(**spec):
        return Study(tmp_path, "s", {"variants": {v: {} for v in plain.variants}, **spec}, [], {})

    assert read_back().pairs == plain.pairs
    none = parse_spec(study_spec(base, str(tmp_path / "out"), axes={}, pairs=[]),
                      str(tmp_path / "s.yaml"))
    assert none.pairs == [] and read_back(pairs=[]).pairs == []
    assert read_back(pairs=[["looped", "scse"]]).pairs == [("looped", "scse")]


@pytest.mark.parametrize("name", ["repro-cpu", "gpt2-small"])
def test_shipped_study_pairs_compare_like_with_like(name):
    """Each paired comparison in a shipped spec holds everything but the method equal: the
    residual (a baseline under another residual measures the residual), data, steps and depth."""
    from scse_dist.study.runs import run_config

    spec = load_spec(REPO_ROOT / "configs" / "studies" / f"{name}.yaml")
    first = {r.variant: r for r in expand(spec, {v: 1e-3 for v in spec.variants}, ("final",))}
    assert len(spec.pairs) == len(spec.variants) - 2  # all but additive-preln/-deeploop
    for a, b in spec.pairs:
        ca, cb = run_config(spec, first[a]), run_config(spec, first[b])
        assert ca.model.residual == cb.model.residual, (a, b)
        assert (ca.data, ca.train.max_steps, ca.model.d_model, ca.model.depth) == \
            (cb.data, cb.train.max_steps, cb.model.d_model, cb.model.depth), (a, b)


@pytest.mark.parametrize("path", sorted([*(REPO_ROOT / "configs" / "studies").glob("*.yaml"),
                                         *(REPO_ROOT / "research" / "specs").glob("*.yaml")]),
                         ids=lambda p: p.stem)
def test_every_shipped_study_spec_resolves_every_run(path):
    """Each spec in configs/studies/ (a user's) and research/specs/ (the record's) loads, and each
    of its runs resolves to a valid run config (a mistyped override or a switch the model refuses
    fails here, not hours into a study)."""
    from scse_dist.study.runs import run_config

    spec = load_spec(path)
    runs = expand(spec, {v: 1e-3 for v in spec.variants}, ("final",))
    assert len(runs) == len(spec.variants) * len(spec.seeds)
    configs = [run_config(spec, r) for r in runs]
    assert {c.train.seed for c in configs} == set(spec.seeds)


@pytest.mark.parametrize("change, message", [
    ({"seeds": [0, 0]}, "seeds: a non-empty list of distinct integers"),
    ({"variants": {"scse": {"override": {}}}}, "variants.scse: expected {overrides:"),
    ({"lr": {"values": [1e-3]}}, "lr: missing field 'validation'"),
    ({"variants": {"scse": {"overrides": {}, "lr": {"key": "train.optimizer.muon_lr",
                                                    "values": [0.02]}}}},
     "variants.scse.lr: needs the study's lr: section"),
    ({"variants": {"scse": {"overrides": {}, "lr": {"key": "muon_lr", "values": [0.02]}}}},
     "variants.scse.lr.key: a train.* field such as train.optimizer.muon_lr, got 'muon_lr'"),
    ({"variants": {"scse": {"overrides": {}, "lr": {"values": [0]}}}},
     "variants.scse.lr.values: a non-empty list of positive rates"),
    ({"axes": {"model.residual": {"values": ["preln"], "variants": ["nope"]}}},
     "axes.model.residual.variants: 'nope' is not a variant"),
    ({"pairs": [["scse", "untied"]]}, "pairs[0]: 'untied' is not a variant"),
    ({"evals": {"tasks": ["mmlu"]}}, "evals.tasks: 'mmlu' is not one of"),
    ({"variants": {"scse": {"overrides": {"model.recurrence": "rnn"}}}},
     "variants.scse (run "),  # the run config's own error follows: model.recurrence: must be one of
    ({"sedes": [0]}, "sedes: unknown field (did you mean 'seeds'?)"),
    ({"evals": {"task": ["heldout"]}}, "evals.task: unknown field (did you mean 'tasks'?)"),
    ({"order": "random"}, "order: one of seed-major, variant-major, got 'random'"),
    ({"resources": {"gpus": 1}}, "resources.gpus: unknown field (did you mean 'gpus_per_node'?)"),
    ({"resources": {"nodes": 0}},
     "resources: nodes, tasks_per_node and cpus_per_task must be >= 1"),
    ({"slurm": {"nodes": 0}}, "slurm: nodes, tasks_per_node and cpus_per_task must be >= 1"),
    ({"slurm": {}, "resources": {}}, "slurm: is the old name of resources:; give one of them"),
    ({"report": {"metrics": {"lambada": ["acc"]}}},
     "report.metrics.lambada: 'acc' is not a metric of lambada (lambada writes ppl, accuracy"),
    ({"report": {"metrics": {"wikitext": ["bpb"]}}},
     "report.metrics.wikitext: 'bpb' is not a metric"),
])
def test_bad_spec_names_the_field(tmp_path, tiny_config, change, message):
    spec = study_spec(tiny_config(tmp_path), str(tmp_path / "out"), **{"axes": {}, **change})
    with pytest.raises(SpecError) as err:
        check_runs(parse_spec(spec, "spec.yaml"))  # the last: each variant's run config loads
    assert str(err.value).startswith("spec.yaml: ") and message in str(err.value), str(err.value)


def test_dry_run_table_and_bad_spec_exit_status(tmp_path, tiny_config):
    path = write_spec(tmp_path / "spec.yaml",
                      study_spec(tiny_config(tmp_path), str(tmp_path / "out")))
    out = study(path, "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()[:-2]
    # then its stages, and the files it evaluates on, by name
    assert out.stdout.splitlines()[-2:] == [
        "stages: final (15 runs at seeds 0, 1, 2) -> report",
        "evaluation file: heldout (test): data.path's held-out split"]
    assert lines[0].split() == ["variant", "seed", "lr", "stage", "run_dir", "status"]
    assert len(lines) == 1 + 5 * 3 and all(line.split()[-1] == "new" for line in lines[1:])
    # the rate each run trains at (the base config's, without a sweep)
    assert lines[1].split() == ["scse-preln", "0", "0.003", "final",
                                str(tmp_path / "out/s/scse-preln/scse-preln-seed0"), "new"]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert not out.stderr  # every input is there
    bad = study(path, "--dry-run", "seeds=[]")
    assert bad.returncode == 2 and "seeds: a non-empty list" in bad.stderr and not bad.stdout
    sweep = study(path, "--dry-run", "lr={values: [0.001], validation: v.txt}")
    assert {line.split()[2] for line in sweep.stdout.splitlines()[1:]
            if "final" in line and not line.startswith("stages: ")} == {"from-sweep"}


def test_dry_run_names_every_missing_input_and_the_runs_that_need_it(tmp_path, tiny_config):
    spec = study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={},
                      evals={"tasks": ["heldout", "lambada"],
                             "lambada": str(tmp_path / "lambada.txt")})
    spec["variants"]["looped"]["overrides"]["data.path"] = str(tmp_path / "gone")
    out = study(write_spec(tmp_path / "spec.yaml", spec), "--dry-run")
    assert out.returncode == 66 and len(out.stdout.splitlines()) == 1 + 3 * 3 + 3  # + stages, files
    assert out.stdout.splitlines()[-2] == \
        f"evaluation file: lambada (test): {tmp_path / 'lambada.txt'}"
    assert out.stderr.splitlines() == [
        f"scse-study: missing input: eval.task_settings.lambada.path {tmp_path / 'lambada.txt'} "
        "(no such file or directory), needed by all 9 runs",
        f"scse-study: missing input: data.path {tmp_path / 'gone'} (no such file or directory), "
        "needed by 3 run(s): looped-seed0, looped-seed1, looped-seed2"]
    # a sweep reads lr.validation and no test file; the final runs read the test files
    spec["variants"]["looped"]["overrides"].pop("data.path")
    spec["lr"] = {"values": [1e-3], "validation": str(tmp_path / "valid.txt")}
    out = study(write_spec(tmp_path / "spec.yaml", spec), "--dry-run")
    assert out.returncode == 66 and \
        [line.split("needed by ")[1] for line in out.stderr.splitlines()] == \
        ["all 3 sweep runs", "all 9 final runs"], out.stderr


@pytest.mark.slow
def test_local_study_sweeps_lr_trains_evaluates_and_rerun_skips(tmp_path, tiny_config, user_env):
    base = tiny_config(tmp_path, "train.max_steps=4", "train.checkpoint.every=2")
    (tmp_path / "valid.txt").write_text("\n\n".join(tiny_documents(8, seed=7)))
    spec = {"name": "local", "out": str(tmp_path / "studies"), "base": base,
            "variants": {"scse": {"overrides": {}}}, "seeds": [1],
            "lr": {"values": [1e-4, 3e-3], "seed": 0, "validation": str(tmp_path / "valid.txt")},
            "evals": {"tasks": ["heldout"], "depths": [1, 2]}}
    path = write_spec(tmp_path / "spec.yaml", spec)
    first = study(path, "--local", env=user_env)
    d = tmp_path / "studies" / "local"
    runs = json.loads((d / "runs.json").read_text())
    assert [(r["stage"], r["lr"], r["run_dir"]) for r in runs] == [
        ("sweep", 1e-4, str(d / "scse/scse-lr0.0001-seed0")),
        ("sweep", 3e-3, str(d / "scse/scse-lr0.003-seed0")),
        ("final", 3e-3, str(d / "scse/scse-seed1"))], first.stdout + first.stderr
    choice = json.loads((d / "lr_choice.json").read_text())["scse"]
    scores = {lr: json.loads((d / f"scse/scse-lr{lr}-seed0/eval/validation.json").read_text())
              ["results"][0]["loss"] for lr in ("0.0001", "0.003")}
    assert choice["scores"] == scores and choice["lr"] == 3e-3 == float(min(scores, key=scores.get))
    final = yaml.safe_load((d / "scse/scse-seed1/config.yaml").read_text())
    assert (final["train"]["optimizer"]["lr"], final["train"]["seed"], final["name"]) == \
        (3e-3, 1, "scse-seed1")
    heldout = json.loads((d / "scse/scse-seed1/eval/heldout.json").read_text())
    assert heldout["checkpoint"] == "scse-seed1@export"  # the results say which run they are
    assert [r["depth"] for r in heldout["results"]] == [1, 2]
    assert (yaml.safe_load((d / "study.yaml").read_text())["variants"] == {"scse": {}})
    assert first.stdout.count("] starting ") == 3 and ", ETA " in first.stdout
    assert first.returncode == 0, first.stderr

    # Rerun: nothing trains again; the final run made partial again resumes (its export removed).
    import shutil
    shutil.rmtree(d / "scse/scse-seed1/export")
    table = study(path, "--dry-run")
    assert [line.split()[-1] for line in table.stdout.splitlines()[1:4]] == \
        ["done", "done", "partial"]
    again = study(path, "--local", env=user_env)
    assert "sweep stage: 2 of 2 runs done, 0 to run" in again.stdout
    assert "final stage: 0 of 1 runs done, 1 to run" in again.stdout
    assert again.stdout.count("] resuming ") == 1 and "] starting " not in again.stdout
    assert "resumed" in again.stdout + again.stderr  # the trainer resumed the step-4 checkpoint
    assert (d / "scse/scse-seed1/export/model.safetensors").is_file()


@pytest.mark.slow
def test_local_study_stops_when_its_first_runs_fail_on_the_same_input(tmp_path, tiny_config,
                                                                      user_env):
    spec = study_spec(tiny_config(tmp_path), str(tmp_path / "out"), axes={}, seeds=[0],
                      overrides={"data.path": str(tmp_path / "no-shards")})
    out = study(write_spec(tmp_path / "spec.yaml", spec), "--local", env=user_env)
    assert out.returncode == 66, out.stderr
    assert out.stdout.count("] starting ") == 2  # looped never started
    errors = [line for line in out.stderr.splitlines() if line.startswith("scse-train: error:")]
    assert len(errors) == 2 and errors[0] == errors[1]
    assert f"data.path: '{tmp_path / 'no-shards'}' does not exist" in errors[0]
    assert out.stderr.splitlines()[-1] == \
        f"scse-study: stopped: the first 2 runs failed alike (exit 66): {errors[0]}", out.stderr


@pytest.mark.parametrize("name, variants, sweep, final", [("repro-cpu", 9, 27, 27),
                                                         ("gpt2-small", 9, 27, 27)])
def test_shipped_study_specs_parse_and_expand(name, variants, sweep, final):
    spec = load_spec(REPO_ROOT / "configs" / "studies" / f"{name}.yaml")
    assert len(spec.variants) == variants and "untied" in spec.variants
    assert {"scse-preln", "scse-deeploop", "additive-preln", "additive-deeploop"} <= \
        set(spec.variants)
    stages = [r.stage for r in expand(spec)]
    assert (stages.count("sweep"), stages.count("final")) == (sweep, final)
    assert spec.evals.depths[-1] == (48 if name == "gpt2-small" else 32)
    assert spec.study_dir == REPO_ROOT / "studies" / name  # out: ../../studies, from the spec file
    # diagnose: the loop flags and plot
    assert spec.evals.tasks == ["heldout", "wikitext", "lambada", "diagnose"]
    assert not set(spec.lr.validation.split("/")) & {"wiki.valid.raw", "lambada-dev.txt"}


def test_shipped_cpu_cluster_study_runs_on_cpu_nodes_seed_major():
    spec = load_spec(REPO_ROOT / "configs" / "studies" / "cpu-cluster.yaml")
    assert spec.resources == Resources(nodes=1, tasks_per_node=1, gpus_per_node=0, cpus_per_task=1,
                                       time_min=20)
    assert spec.study_dir == REPO_ROOT / "studies" / "cpu-cluster"
    assert [Path(r.run_dir).name for r in expand(spec)] == [
        "scse-seed0", "additive-seed0", "looped-seed0",
        "scse-seed1", "additive-seed1", "looped-seed1"]
