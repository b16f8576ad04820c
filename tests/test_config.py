"""Config loading: YAML + overrides map onto typed fields; bad input names the field."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from scse_dist.config import config_to_dict, load_config, save_config
from scse_dist.model.transitions import transition_for
from scse_dist.typed_yaml import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_resolve_derived_fields():
    cfg = load_config(None)
    assert cfg.model.recurrence == "scse" and cfg.model.residual == "deeploop"
    assert transition_for(cfg.model).resolved_inject == "none"
    assert cfg.model.resolved_ffn_hidden == 704  # 8/3*256 = 682 -> next multiple of 64
    assert transition_for(cfg.model).unrolled_depth == 1 + 1 * 4 + 1
    assert cfg.run_dir == "runs/run"


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["model.recurrence=additive", "train.optimizer.lr=3e-4",
                             "eval.depths=1,8,48",
                             "train.depth.kind=uniform", "wandb.enabled=false", "model.depth=8"])
    assert transition_for(cfg.model).resolved_inject == "add"
    assert cfg.train.optimizer.lr == pytest.approx(3e-4) and isinstance(cfg.train.optimizer.lr,
                                                                        float)
    assert cfg.eval.depths == [1, 8, 48]
    assert cfg.train.depth.kind == "uniform" and cfg.wandb.enabled is False
    assert transition_for(cfg.model).unrolled_depth == 10


def test_untied_param_match_has_no_loop_visits():
    cfg = load_config(None, ["model.recurrence=untied", "model.untied_match=params",
                             "model.residual=preln"])
    assert transition_for(cfg.model).unrolled_depth == 3


@pytest.mark.parametrize("override, message", [
    ("model.recurence=scse", "model.recurence: unknown field (did you mean 'recurrence'?)"),
    ("model.recurrence=transformer",
     "model.recurrence: must be one of untied, looped, additive, scse"),
    ("model.depth=0", "model.depth: must be > 0, got 0"),
    ("train.optimizer.lr=fast", "train.optimizer.lr: expected a number, got 'fast'"),
    ("model.zero_mask=3", "model.zero_mask: expected true or false, got 3"),
    ("model.forcing_bias_scale=0.5",
     "model.zero_mask: the zero-deviation mask belongs to forcing_bias_scale=0"),
    ("model.forcing_bias_scale=1.5", "model.forcing_bias_scale: must lie in [0, 1], got 1.5"),
    ("model.n_heads=3", "model.n_heads: d_model=256 must split into 3 heads"),
    ("train.engine.zero_stage=4", "train.engine.zero_stage: must lie in [0, 3], got 4"),
    ("train.engine.compile=yes please",
     "train.engine.compile: expected true or false, got 'yes please'"),
    ("data.seq_len=4096", "data.seq_len: 4096 exceeds model.max_seq_len=256"),
    ("eval.depths=[0,4]", "eval.depths: need a non-empty list of depths >= 1"),
    ("train.depth.kind=geometric",
     "train.depth.kind: must be one of fixed, uniform, poisson_lognormal"),
    ("model=3", "model: expected a mapping, got int 3"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_source_anchor_with_source_init_is_refused():
    with pytest.raises(ConfigError, match="model.init_state: anchor=source with init_state=source"):
        load_config(None, ["model.anchor=source"])
    cfg = load_config(None, ["model.anchor=source", "model.init_state=zeros"])
    assert cfg.model.anchor == "source"


def test_mask_off_allows_forcing_bias():
    cfg = load_config(None, ["model.zero_mask=false", "model.forcing_bias_scale=1"])
    assert cfg.model.forcing_bias_scale == 1.0


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:1: not valid YAML \(expected"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(typo)
    assert "train.max_step: unknown field (did you mean 'max_steps'?)" in str(err.value)
    assert "typo.yaml" in str(err.value)


def test_an_error_names_where_it_is_fixed_the_file_or_the_command_line(tmp_path):
    good, typo = tmp_path / "good.yaml", tmp_path / "typo.yaml"
    good.write_text("train:\n  max_steps: 3\n")
    typo.write_text("train:\n  max_step: 3\n")

    def error(path, overrides):
        with pytest.raises(ConfigError) as err:
            load_config(path, overrides)
        return str(err.value)

    unknown = "train.max_step: unknown field (did you mean 'max_steps'?)"
    # a typo in an override is the command line's, even with a file given; only its override named
    assert error(good, ["name=x", "train.max_step=4"]) == \
        f"{unknown} (on the command line: train.max_step=4)"
    assert error(None, ["train.max_step=4"]) == f"{unknown} (on the command line: train.max_step=4)"
    # a clash an override causes with the file's values: the command line, all of it shown
    assert error(good, ["model.max_seq_len=64", "name=x"]) == (
        "data.seq_len: 256 exceeds model.max_seq_len=64 (on the command line: model.max_seq_len=64 "
        "name=x)")
    # the file's own error stays the file's, overrides or not
    assert error(typo, ["name=x"]) == f"{unknown} (in {typo})"
    assert error(typo, []) == f"{unknown} (in {typo})"


def test_save_then_load_round_trips(tmp_path):
    cfg = load_config(None, ["model.recurrence=looped", "eval.depths=2,3",
                             "data.build=stdlib_docs"])
    save_config(cfg, tmp_path / "c.yaml")
    assert config_to_dict(load_config(tmp_path / "c.yaml")) == config_to_dict(cfg)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.name == path.stem


def test_base_file_is_overlaid(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\n"
                                     "model: {recurrence: scse, d_model: 64, n_heads: 2}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\nmodel: {recurrence: additive}\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.name, cfg.model.recurrence, cfg.model.d_model, cfg.model.n_heads) == \
        ("b", "additive", 64, 2)
    (tmp_path / "c.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "c.yaml")


def _field_paths(cls, prefix=""):
    import dataclasses
    import typing
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_docs_document_every_config_field():
    """docs/config.md's table against the dataclasses: every field has a row, and every name in
    the table's first column is a field (none renamed or removed and left behind)."""
    import re

    from scse_dist.config import RunConfig
    reference = (REPO / "docs" / "config.md").read_text()
    fields = set(_field_paths(RunConfig))
    missing = [p for p in fields if f"`{p}`" not in reference]
    assert not missing, f"docs/config.md's config reference lacks {missing}"
    rows = re.findall(r"^\| (`[^|]*`) \|", reference, flags=re.M)
    named = [n for row in rows for n in re.findall(r"`([^`]+)`", row)]
    assert len(named) > 100  # the table was found
    stale = [n for n in named if n not in fields]
    assert not stale, f"docs/config.md names fields the config does not have: {stale}"


# What a config of before the train sections wrote (flat names, a value where a section is now).
OLD_TRAIN = """name: old
train:
  max_steps: 40
  micro_batch_size: 2
  global_batch_size: 16
  zero_stage: 0
  compile: true
  optimizer: muon
  lr: 2.0e-3
  lr_mult: {embed: 2.0}
  beta2: 0.99
  grad_clip: 0.5
  muon_lr: 0.01
  update_clip: 1.0
  schedule: wsd
  warmup_steps: 4
  decay_steps: 10
  min_lr_ratio: 0.0
  resume: require
  init_from_strict: false
  max_retries: 0
  z_loss: 1.0e-4
  depth_loss: {kind: two_depths, short: 3}
  checkpoint_every: 7
"""


def test_old_flat_train_names_load_into_their_sections_with_one_notice_each(tmp_path, capfd):
    import scse_dist.typed_yaml as typed_yaml

    typed_yaml._noticed.clear()
    (tmp_path / "old.yaml").write_text(OLD_TRAIN)
    cfg = load_config(tmp_path / "old.yaml")
    t, o, s = cfg.train, cfg.train.optimizer, cfg.train.schedule
    assert (o.kind, o.lr, o.lr_mult, o.beta2, o.grad_clip, o.muon_lr, o.update_clip) == \
        ("muon", 2e-3, {"embed": 2.0}, 0.99, 0.5, 0.01, 1.0)
    assert (s.kind, s.warmup_steps, s.decay_steps, s.min_lr_ratio) == ("wsd", 4, 10, 0.0)
    assert (t.start.resume, t.start.init_from_strict, t.max_steps) == ("require", False, 40)
    assert (t.batch.micro_batch_size, t.batch.global_batch_size) == (2, 16)
    assert (t.engine.zero_stage, t.engine.compile, cfg.launch.max_retries) == (0, True, 0)
    assert (t.loss.z_loss, t.loss.depth.kind, t.loss.depth.short) == (1e-4, "two_depths", 3)
    assert (t.checkpoint.every, t.checkpoint.keep) == (7, 2)
    notices = capfd.readouterr().err.splitlines()
    assert "config: notice: train.lr is now train.optimizer.lr; the old name is read for now" \
        in notices
    assert "config: notice: train.optimizer is now train.optimizer.kind; the old name is read " \
        "for now" in notices
    assert "config: notice: train.micro_batch_size is now train.batch.micro_batch_size; the old " \
        "name is read for now" in notices
    assert "config: notice: train.max_retries is now launch.max_retries; the old name is read " \
        "for now" in notices
    assert len(notices) == 21  # one per old name in the file, once per process
    load_config(tmp_path / "old.yaml")
    assert capfd.readouterr().err == ""
    # the same config in the new names is the same config
    new = load_config(None, ["name=old", "train.max_steps=40", "train.batch.micro_batch_size=2",
                             "train.batch.global_batch_size=16", "train.engine.zero_stage=0",
                             "train.engine.compile=true", "train.optimizer.kind=muon",
                             "train.optimizer.lr=2e-3", "train.optimizer.lr_mult={embed: 2.0}",
                             "train.optimizer.beta2=0.99", "train.optimizer.grad_clip=0.5",
                             "train.optimizer.muon_lr=0.01", "train.optimizer.update_clip=1.0",
                             "train.schedule.kind=wsd", "train.schedule.warmup_steps=4",
                             "train.schedule.decay_steps=10", "train.schedule.min_lr_ratio=0",
                             "train.start.resume=require", "train.start.init_from_strict=false",
                             "launch.max_retries=0", "train.loss.z_loss=1e-4",
                             "train.loss.depth.kind=two_depths", "train.loss.depth.short=3",
                             "train.checkpoint.every=7"])
    assert config_to_dict(new) == config_to_dict(load_config(tmp_path / "old.yaml"))


def test_a_later_layer_wins_whichever_names_each_uses(tmp_path):
    """An override, or a file overlaying its base, sets the field whether it or the layer under
    it uses the old flat name or the new one (each layer is renamed before the next lands)."""
    (tmp_path / "new.yaml").write_text("train: {optimizer: {lr: 1.0e-3}, schedule: {kind: wsd}}\n")
    (tmp_path / "old.yaml").write_text("train: {lr: 1.0e-3, schedule: wsd}\n")
    for base in ("new.yaml", "old.yaml"):
        assert load_config(tmp_path / base, ["train.lr=5e-3"]).train.optimizer.lr == 5e-3
        assert load_config(tmp_path / base,
                           ["train.optimizer.lr=5e-3"]).train.optimizer.lr == 5e-3
        assert load_config(tmp_path / base, ["train.schedule=cosine"]).train.schedule.kind == \
            "cosine"
        for over, kind in (("train: {lr: 7.0e-3, schedule: linear}", "old"),
                           ("train: {optimizer: {lr: 7.0e-3}, schedule: {kind: linear}}", "new")):
            (tmp_path / f"{kind}-over-{base}").write_text(f"base: {base}\n{over}\n")
            t = load_config(tmp_path / f"{kind}-over-{base}").train
            assert (t.optimizer.lr, t.schedule.kind) == (7e-3, "linear")
    # a key inside an old name moves with it
    assert load_config(None, ["train.lr_mult.embed=3"]).train.optimizer.lr_mult == {"embed": 3.0}


def test_a_saved_run_config_of_before_loads(tmp_path):
    """A run's config.yaml written with the flat names (every train field, as dataclasses.asdict
    wrote them) loads with its values, as a resume or an evaluation reads it."""
    from scse_dist.config import load_saved_config

    old = config_to_dict(load_config(None, ["train.optimizer.lr=2e-3",
                                            "train.batch.grad_accum_steps=3",
                                            "train.engine.precision=fp32",
                                            "train.schedule.warmup_steps=7",
                                            "train.start.resume=never"]))
    train = old["train"]
    for section in ("batch", "engine", "optimizer", "schedule", "start"):
        for name, value in train.pop(section).items():
            train[{"kind": section}.get(name, name)] = value
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    t = load_saved_config(tmp_path / "config.yaml").train
    assert (t.optimizer.lr, t.schedule.warmup_steps, t.start.resume) == (2e-3, 7, "never")
    assert (t.batch.grad_accum_steps, t.engine.precision) == (3, "fp32")
    assert (t.optimizer.kind, t.schedule.kind) == ("torch_adamw", "cosine")


@pytest.mark.parametrize("cls, override, message", [
    ("DataConfig", "data.heldout_fraction=1.0", "must lie in [0, 1), got 1.0"),
    ("DepthSamplingConfig", "train.depth.sigma=0", "must be > 0, got 0.0"),
    ("EvalConfig", "eval.batch_size=0", "must be > 0, got 0"),
    ("ModelConfig", "model.loop_stability=.nan", "must be >= 0, got nan"),
    ("LossConfig", "train.loss.z_loss=.inf", "must be a finite number >= 0, got inf"),
])
def test_bounds_are_declared_on_the_fields_and_checked_in_one_place(cls, override, message):
    """A field's bounds are its metadata, and the loader checks them for every dataclass it
    builds (build_dataclass: each section, a task's settings, a callback's Config); a config file
    or an override gets the same message."""
    from scse_dist.data.config import DataConfig
    from scse_dist.eval.config import EvalConfig
    from scse_dist.model.config import ModelConfig
    from scse_dist.train.depth_config import DepthSamplingConfig
    from scse_dist.train.loss_config import LossConfig
    from scse_dist.typed_yaml import build_dataclass

    built = {"DataConfig": DataConfig, "DepthSamplingConfig": DepthSamplingConfig,
             "EvalConfig": EvalConfig, "ModelConfig": ModelConfig, "LossConfig": LossConfig}[cls]
    key, raw = override.split("=")
    where, name = key.rsplit(".", 1)
    with pytest.raises(ConfigError) as err:
        build_dataclass(built, {name: yaml.safe_load(raw)}, where)
    assert str(err.value) == f"{key}: {message}"
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == f"{key}: {message} (on the command line: {override})"


def test_every_declared_bound_is_known_and_holds_for_its_default():
    """Each bound a field declares is one the loader knows (a misspelt one would check nothing),
    and each default lies within its field's bounds: the sections, tasks' settings, callbacks."""
    import importlib
    import typing

    from scse_dist.config import RunConfig
    from scse_dist.model.config import BOUNDS, bound_problem
    from scse_dist.task_registry import TASKS
    from scse_dist.train.config import BUILT_IN_CALLBACKS, BUILT_INS

    callbacks = [getattr(importlib.import_module(f"{BUILT_INS}.{path.split(':')[0]}"),
                         path.split(":")[1]) for path in BUILT_IN_CALLBACKS.values()]
    todo = [RunConfig, *(t.settings for t in TASKS.values() if t.settings),
            *(c.Config for c in callbacks if c.Config is not None)]
    seen, bounded = set(), 0
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert set(f.metadata) <= {*BOUNDS, "finite", "note"}, (cls, f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            assert bound_problem(f, default) is None, (cls, f.name)
            bounded += bool(f.metadata)
            todo += [t for t in (hints[f.name], *typing.get_args(hints[f.name]))
                     if dataclasses.is_dataclass(t)]
    assert bounded >= 50, bounded


# The built-in callbacks' old settings (now their train.callbacks entries'), as a saved run's
# config of then held them, and the same run by the new names.
OLD_CALLBACK_KEYS = {"train": {"max_nonfinite_steps": 7, "diagnostics_every": 0, "callbacks": [],
                               "spike_skip": {"enabled": True, "k": 3.0}},
                     "profile": {"enabled": True, "steps": 3},
                     "eval": {"every_steps": 5, "sample_every": 4, "sample_prompts": ["a"],
                              "sample_tokens": 8, "sample_temperature": 0.0,
                              "downstream_every": 0, "downstream_tasks": [],
                              "downstream_max_examples": 9}}
NEW_CALLBACK_KEYS = {"nonfinite": {"init_args": {"max_in_a_row": 7}},
                     "diagnostics": {"init_args": {"every_steps": 0}},
                     "spike_skip": {"enabled": True, "init_args": {"k": 3.0}},
                     "profiler": {"enabled": True, "init_args": {"steps": 3}},
                     "heldout_eval": {"init_args": {"every_steps": 5}},
                     "samples": {"init_args": {"every_steps": 4, "prompts": ["a"], "tokens": 8,
                                               "temperature": 0.0}},
                     "downstream": {"init_args": {"every_steps": 0, "tasks": [],
                                                  "max_examples": 9}}}


def test_the_built_in_callbacks_old_settings_load_with_one_notice_each(tmp_path, capsys):
    import copy
    import json

    import scse_dist.typed_yaml as typed_yaml
    from scse_dist.checkpoint.resume import refused_changes
    from scse_dist.config import read_saved_config

    typed_yaml._noticed.clear()
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(OLD_CALLBACK_KEYS))
    (tmp_path / "new.yaml").write_text(yaml.safe_dump({"train": {"callbacks": NEW_CALLBACK_KEYS}}))
    old = load_config(tmp_path / "old.yaml")
    notices = capsys.readouterr().err.splitlines()
    assert len(notices) == len(set(notices)) == 14  # one per old name, each once
    assert all(n.startswith("config: notice: ") for n in notices)
    assert old == load_config(tmp_path / "new.yaml")
    overrides = [f"{k}={json.dumps(v)}" for k, v in (
        ("train.max_nonfinite_steps", 7), ("eval.sample_prompts", ["a"]), ("profile.steps", 3))]
    by_override = load_config(None, overrides).train.callbacks
    assert (by_override["nonfinite"].init_args, by_override["samples"].init_args,
            by_override["profiler"].init_args) == ({"max_in_a_row": 7}, {"prompts": ["a"]},
                                                   {"steps": 3})
    assert capsys.readouterr().err == ""  # said once per process
    # a saved run config of then resumes: none of them is a refused change
    saved = config_to_dict(load_config(None))
    for section, fields in OLD_CALLBACK_KEYS.items():
        saved.setdefault(section, {}).update(copy.deepcopy(fields))  # callbacks: [] as then
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert refused_changes(read_saved_config(tmp_path / "config.json"), config_to_dict(old)) == []
    assert capsys.readouterr().err == ""  # said once per process
