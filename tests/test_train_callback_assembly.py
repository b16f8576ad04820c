"""A run's callbacks (scse_dist.train.callbacks.assembly): train.callbacks entries built or refused
in one line, the hook order by priority, states saved and restored. A toy callback of a user's
own (tests/toy_callback.py, added the way docs/architecture.md says) runs on a TrainState with no
training; the slow test resumes a real run at another world size and finds every state there."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass

import pytest
import torch

from conftest import step_result
from scse_dist.config import RunConfig, load_config
from scse_dist.model.config import ModelConfig
from scse_dist.train.callbacks.assembly import (
    callback_states,
    check_callbacks,
    configured_callbacks,
    in_hook_order,
    restore_states,
    state_keys,
)
from scse_dist.train.callbacks.base import Callback
from scse_dist.train.config import CallbackSpec, TrainConfig
from scse_dist.typed_yaml import ConfigError
from toy_callback import StepCounter
from train_procs import REPO, TRAIN, read_metrics, train_ranks

TOY = "toy_callback:StepCounter"


def spec(class_path: str = TOY, **kw) -> CallbackSpec:
    return CallbackSpec(class_path, **kw)


def drive(state, callbacks: list[Callback], losses: list[float], skipped: set[int] = frozenset()):
    """The loop's hook calls for len(losses) steps, as train() makes them, without a model step."""
    for callback in callbacks:
        callback.on_start(state)
    for step, loss in enumerate(losses, start=state.start_step + 1):
        state.result = step_result(loss, skipped=step in skipped)
        state.lr, state.step_seconds, state.step = 1e-3, 0.01, step
        for callback in callbacks:
            callback.on_step_end(state)


# --------------------------------------------------------------------------- config entries


def entries(*specs: CallbackSpec) -> RunConfig:
    """A run config whose train.callbacks is `specs` alone ("mine", "mine2", ...), no built-in."""
    cfg = RunConfig()
    cfg.train.callbacks = {f"mine{i or ''}": spec for i, spec in enumerate(specs)}
    return cfg


def test_an_entry_is_built_with_its_config_and_priority():
    [toy] = configured_callbacks(entries(spec(init_args={"every_steps": 3}, priority=7)))
    assert isinstance(toy, StepCounter) and toy.every_steps == 3 and toy.priority == 7
    [plain] = configured_callbacks(entries(spec()))
    assert plain.every_steps == 5 and plain.priority == 350 == StepCounter.priority


@pytest.mark.parametrize("entry, message", [
    (spec("no_such_module:Toy"), "train.callbacks.mine.class_path: 'no_such_module:Toy': cannot "
                                 "import no_such_module (No module named 'no_such_module')"),
    (spec("toy_callback:Nope"), "train.callbacks.mine.class_path: 'toy_callback:Nope': "
                                "toy_callback has no Nope"),
    (spec("json:JSONDecoder"), "train.callbacks.mine.class_path: 'json:JSONDecoder' is not a "
                               "subclass of scse_dist.train.callbacks.Callback"),
    (spec(init_args={"every": 3}), "train.callbacks.mine.init_args.every: unknown field (did you "
                                   "mean 'every_steps'?)"),
    (spec(init_args={"every_steps": "often"}), "train.callbacks.mine.init_args.every_steps: "
                                               "expected an integer, got 'often'"),
    (spec("scse_dist.train.callbacks.export:ExportCallback", init_args={"x": 1}),
     "train.callbacks.mine.init_args: scse_dist.train.callbacks.export:ExportCallback declares no "
     "Config dataclass, so it takes none; got x"),
])
def test_a_bad_entry_is_one_config_error_naming_it(entry, message):
    with pytest.raises(ConfigError) as err:
        check_callbacks(entries(entry))
    assert str(err.value) == message


class Needs(Callback):
    @dataclass
    class Config:
        threshold: float

    def __init__(self, config: Config) -> None:
        self.threshold = config.threshold


def test_a_required_init_arg_is_named():
    path = f"{__name__}:Needs"
    with pytest.raises(ConfigError) as err:
        check_callbacks(entries(spec(path)))
    assert str(err.value) == \
        f"train.callbacks.mine.init_args.threshold: required by {path}, missing"
    [built] = configured_callbacks(entries(spec(path, init_args={"threshold": 2})))
    assert built.threshold == 2.0


class Sized(Callback):
    """Reads two sections besides its Config: they come by the names of its parameters."""

    @dataclass
    class Config:
        every_steps: int = 1

        def check(self, train: TrainConfig) -> None:
            if self.every_steps > train.max_steps:
                raise ConfigError(f"init_args.every_steps: past train.max_steps={train.max_steps}")

    def __init__(self, config: Config, model: ModelConfig, train: TrainConfig) -> None:
        self.every_steps = config.every_steps
        self.depth, self.max_steps = model.depth, train.max_steps


def test_an_entry_gets_the_sections_its_constructor_and_check_name():
    path = f"{__name__}:Sized"
    cfg = entries(spec(path, init_args={"every_steps": 3}))
    cfg.model.depth, cfg.train.max_steps = 7, 9
    [built] = configured_callbacks(cfg)
    assert (built.every_steps, built.depth, built.max_steps) == (3, 7, 9)
    cfg.train.max_steps = 2
    with pytest.raises(ConfigError) as err:
        check_callbacks(cfg)
    assert str(err.value) == "train.callbacks.mine.init_args.every_steps: past train.max_steps=2"


def test_the_config_checks_an_entrys_form_without_importing_it(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match=r"^train.callbacks.b.class_path: expected "
                                          r"'package.module:Class', "
                                          r"got 'toy_callback.StepCounter'"):
        load_config(tiny_config(tmp_path, f"train.callbacks={{a: {{class_path: {TOY}}}, "
                                          "b: {class_path: toy_callback.StepCounter}}"))
    cfg = load_config(tiny_config(tmp_path, "train.callbacks={x: {class_path: not_installed:X, "
                                            "init_args: {anything: [1, 2]}}}"))
    assert cfg.train.callbacks["x"] == spec("not_installed:X", init_args={"anything": [1, 2]})
    assert list(cfg.train.callbacks)[:2] == ["nonfinite", "spike_skip"]  # the built-ins first


def test_a_list_of_entries_still_loads_keyed_by_class_path_with_one_notice(tiny_config, tmp_path,
                                                                           capsys):
    import scse_dist.typed_yaml as typed_yaml

    typed_yaml._noticed.clear()
    cfg = load_config(tiny_config(tmp_path, f"train.callbacks=[{{class_path: {TOY}}}, "
                                            f"{{class_path: {TOY}, priority: 1}}]"))
    assert cfg.train.callbacks[TOY] == spec() and cfg.train.callbacks[f"{TOY}#2"].priority == 1
    assert capsys.readouterr().err == ("config: notice: train.callbacks as a list is now a mapping "
                                       "of name: entry; the old name is read for now\n")


# --------------------------------------------------------------------------- order and state


def built_in_callbacks(cfg):
    """The callbacks train() runs for `cfg`: its enabled entries with work in this run."""
    return [c for c in configured_callbacks(cfg) if c.for_run()]


def test_the_built_ins_keep_their_order_and_an_entry_takes_its_place(tiny_config, tmp_path):
    cfg = load_config(tiny_config(tmp_path, "train.callbacks.heldout_eval.init_args.every_steps=5",
                                  "train.callbacks.samples.init_args.every_steps=5"))
    built_in = built_in_callbacks(cfg)
    assert in_hook_order(built_in) == built_in
    names = lambda cbs: [type(c).__name__ for c in cbs]  # noqa: E731
    assert names(built_in) == [
        "NonFiniteCallback", "LoopDiagnosticsCallback", "MetricsCallback",
        "HeldoutEvalCallback", "SampleCallback", "CheckpointCallback", "PreemptionCallback",
        "ExportCallback", "AfterTrainingEval"]
    late, early, default = (StepCounter(StepCounter.Config()) for _ in range(3))
    late.priority, early.priority = -250, 350
    plain = Callback()  # priority 0: after the rows, before the checkpoint
    order = in_hook_order([*built_in, late, early, plain])
    assert order.index(early) == 2 and order.index(plain) == 6
    assert names(order[order.index(late) - 1:][:1]) == ["PreemptionCallback"]
    assert default.priority == 350
    # each built-in from its entry: disabled, or with nothing to do, it is not in the list
    every_on = load_config(tiny_config(
        tmp_path, "train.callbacks.downstream.init_args={every_steps: 5, tasks: [lambada]}",
        f"eval.task_settings.lambada.path={tmp_path / 'lambada.jsonl'}",
        "train.callbacks.spike_skip.enabled=true", "train.callbacks.profiler.enabled=true",
        "train.callbacks.diagnostics.init_args.every_steps=0",
        "train.callbacks.export.enabled=false"))
    assert set(names(built_in_callbacks(every_on))) - set(names(built_in)) == {
        "SpikeSkipCallback", "DownstreamEvalCallback", "ProfilerCallback"}
    assert {"LoopDiagnosticsCallback", "ExportCallback", "HeldoutEvalCallback"}.isdisjoint(
        names(built_in_callbacks(every_on)))
    # an entry that names a built-in moves it: a priority of its own, its init_args laid over
    moved = load_config(tiny_config(tmp_path, "train.callbacks.metrics.priority=-600",
                                    "train.callbacks.heldout_eval.init_args.every_steps=5"))
    assert names(in_hook_order(built_in_callbacks(moved)))[-1] == "MetricsCallback"


def test_states_are_keyed_by_class_repeats_numbered_and_restored():
    a, b = (StepCounter(StepCounter.Config()) for _ in range(2))
    a.steps_seen, b.steps_seen = 4, 9
    keys = state_keys([a, Callback(), b])
    assert keys == [TOY, "scse_dist.train.callbacks.base:Callback", f"{TOY}#2"]
    saved = callback_states([a, Callback(), b])  # a callback without state saves nothing
    assert saved == {TOY: {"steps_seen": 4, "lowest_loss": math.inf},
                     f"{TOY}#2": {"steps_seen": 9, "lowest_loss": math.inf}}
    fresh = [StepCounter(StepCounter.Config()), StepCounter(StepCounter.Config())]
    left = restore_states(fresh, {**saved, "gone.module:Old": {"x": 1}})
    assert [c.steps_seen for c in fresh] == [4, 9] and left == ["gone.module:Old"]


def test_the_toy_joins_the_training_row_and_carries_on_from_its_state(train_state):
    from scse_dist.train.callbacks.metrics import MetricsCallback

    state = train_state("train.log_every=2")
    toy, metrics = StepCounter(StepCounter.Config(every_steps=2)), MetricsCallback()
    drive(state, in_hook_order([metrics, toy]), [3.0, 2.5, 2.0, 2.75])
    rows = read_metrics(state.run_dir)
    assert [(r["step"], r["loss"], r["toy/steps_seen"], r["toy/lowest_loss"]) for r in rows
            if "toy/steps_seen" in r] == [(2, 2.5, 2, 2.5), (4, 2.375, 4, 2.0)]
    assert [r["step"] for r in rows] == [1, 2, 4]  # the first step's row, then every 2 steps
    assert state.first_loss == 3.0 and state.last_loss == 2.375

    # a resume: new instances restored from what a checkpoint saves, at step 4
    saved = callback_states([toy, metrics])
    later = train_state("train.log_every=2")
    later.start_step = later.step = 4
    toy2, metrics2 = StepCounter(StepCounter.Config(every_steps=2)), MetricsCallback()
    assert restore_states([toy2, metrics2], saved) == []
    drive(later, in_hook_order([metrics2, toy2]), [1.5, 1.0])
    last = read_metrics(later.run_dir)[-1]
    assert (last["step"], last["toy/steps_seen"], last["toy/lowest_loss"]) == (6, 6, 1.0)
    assert later.first_loss == 3.0  # the run's first, not the resumed segment's


def test_the_nonfinite_counts_carry_on_from_their_state(train_state):
    from scse_dist.train.callbacks.nonfinite import NonFiniteCallback
    from scse_dist.train.faults import TrainingStopped

    state = train_state()
    first = NonFiniteCallback(NonFiniteCallback.Config(3))
    drive(state, [first], [1.0, math.nan, math.nan], skipped={2, 3})
    assert first.state_dict() == {"total": 2, "in_a_row": 2} and state.skipped_steps == 2
    later, again = train_state(), NonFiniteCallback(NonFiniteCallback.Config(3))
    again.load_state_dict(first.state_dict())
    later.start_step = later.step = 3
    with pytest.raises(TrainingStopped, match="^step 4: 3 non-finite steps in a row"):
        drive(later, [again], [math.nan], skipped={4})
    assert later.skipped_steps == 2  # on_start's, from the state: the stopping step raised
    assert again.state_dict() == {"total": 3, "in_a_row": 3}


# --------------------------------------------------------------------------- a real resume


@pytest.mark.slow
def test_states_survive_a_preemption_and_a_resume_at_another_world_size(
        tmp_path, tiny_config, subprocess_env):
    """1 rank, preempted at step 10 after two non-finite steps; resumed by 2 ranks (ZeRO-1,
    through the universal checkpoint) with one more: the counts go on (3 in a row, 3 in all), the
    toy has seen every step, and the final checkpoint holds the run's first loss."""
    import subprocess

    cfg = tiny_config(tmp_path, "train.batch.global_batch_size=4", "train.batch.micro_batch_size=2",
                      "train.callbacks.nonfinite.init_args.max_in_a_row=4",
                      f"train.callbacks.toy={{class_path: {TOY}, init_args: {{every_steps: 5}}}}")
    env = dict(subprocess_env, PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    first = subprocess.run([sys.executable, TRAIN, "--config", cfg], cwd=REPO, text=True,
                           capture_output=True, timeout=300,
                           env=dict(env, SCSE_FAULT="nan@9,nan@10,sigterm@10"))
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-2000:]
    assert "step 10: non-finite loss or gradient, step skipped (2 in a row, 2 in all)" in \
        first.stdout
    results = train_ranks(cfg, env, world=2, extra_env={"SCSE_FAULT": "nan@11"})
    assert [r.returncode for r in results] == [0, 0], results[0].tail()
    out = results[0].stdout
    assert "saved by 1 ranks, resumed by 2" in out
    assert "step 11: non-finite loss or gradient, step skipped (3 in a row, 3 in all)" in out
    rows = [r for r in read_metrics(tmp_path / "runs" / "tiny") if "loss" in r]
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [
        (1, 0), (5, 0), (10, 2), (11, 3), (15, 3), (20, 3)]
    assert [(r["step"], r["toy/steps_seen"]) for r in rows if "toy/steps_seen" in r] == [
        (5, 5), (10, 10), (15, 15), (20, 20)]
    model_states = tmp_path / "runs" / "tiny" / "checkpoints" / "step-0000020" / \
        "mp_rank_00_model_states.pt"
    saved = torch.load(model_states, weights_only=False)["callbacks"]
    assert saved["scse_dist.train.callbacks.metrics:MetricsCallback"] == {
        "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
    assert saved["scse_dist.train.callbacks.nonfinite:NonFiniteCallback"] == {
        "total": 3, "in_a_row": 0}
    assert saved[TOY]["steps_seen"] == 20


@pytest.mark.slow
def test_mypy_checks_a_callback_against_the_typed_train_state(tmp_path):
    """TrainState and the protocol are typed (no Any for engine, stream, logger, result, ...): the
    package's callbacks and the toy pass mypy, and a typo in a callback is an error."""
    import subprocess

    pytest.importorskip("mypy")
    broken = tmp_path / "broken_callback.py"
    broken.write_text("from scse_dist.train.callbacks import Callback, TrainState\n\n\n"
                      "class Broken(Callback):\n"
                      "    def on_step_end(self, state: TrainState) -> None:\n"
                      "        state.logger.write({'loss': state.result.mean_loss})\n"
                      "        state.stream.epochs += 1\n")
    args = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
            "--no-error-summary", "--cache-dir", str(tmp_path / "cache")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    good = subprocess.run([*args, "scse_dist/train/callbacks", "tests/toy_callback.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert good.returncode == 0, good.stdout
    bad = subprocess.run([*args, str(broken)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env)
    assert bad.returncode == 1
    assert '"StepResult" has no attribute "mean_loss"' in bad.stdout, bad.stdout
    assert "has no attribute \"epochs\"" in bad.stdout, bad.stdout


# --------------------------------------------------------------------------- the built-ins' docs


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of the rows of the markdown table whose header row starts with `header`."""
    rows = itertools.takewhile(lambda line: line.startswith("|"),
                               text[text.index(header):].split("\n")[2:])
    return [[cell.strip().strip("`") for cell in row.strip("|").split(" | ")] for row in rows]


def test_the_callback_tables_of_the_docs_match_the_built_ins():
    """docs/callbacks.md's built-ins (name, class, file, priority, on by default) and settings
    (name.field, default) are the code's: BUILT_IN_CALLBACKS and each class's Config."""
    import dataclasses
    import importlib

    import yaml

    from scse_dist.train.config import BUILT_IN_CALLBACKS, built_in_entries

    text = (REPO / "docs" / "callbacks.md").read_text()
    documented = {name: (int(priority), cls, file, on)
                  for priority, name, cls, file, on, _ in _table(text, "| priority | name |")}
    in_code, settings = {}, {}
    for name, spec in built_in_entries().items():
        module, cls_name = spec.class_path.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        in_code[name] = (cls.priority, cls_name, module.rsplit(".", 1)[1] + ".py",
                         "yes" if spec.enabled else "no")
        for f in dataclasses.fields(cls.Config) if cls.Config else ():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            settings[f"{name}.{f.name}"] = default
    assert list(documented) == list(BUILT_IN_CALLBACKS)  # in hook order, as the defaults
    assert documented == in_code
    assert [in_code[n][0] for n in documented] == sorted((p for p, *_ in in_code.values()),
                                                         reverse=True)
    rows = _table(text, "| setting | default |")
    assert {key: yaml.safe_load(default) for key, default, _ in rows} == settings


def test_each_old_built_in_setting_moves_to_a_setting_of_its_callback():
    import dataclasses
    import importlib

    from scse_dist.config import RENAMED_FIELDS
    from scse_dist.train.config import built_in_entries

    moved = {old: new.split(".")[2:] for old, new in RENAMED_FIELDS.items()
             if new.startswith("train.callbacks.")}
    assert len(moved) == 25
    for name, *where in moved.values():
        module, cls_name = built_in_entries()[name].class_path.split(":")
        config = getattr(importlib.import_module(module), cls_name).Config
        assert where == ["enabled"] or (
            where[0] == "init_args" and where[1] in {f.name for f in dataclasses.fields(config)})
