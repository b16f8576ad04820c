"""A recurrence added the way docs/architecture.md says ("A recurrence"): one Transition subclass
with a name, registered; nothing else of the package changes. The toy here, `relaxed`
(x_{t+1} = (x_t + Phi(x_t)) / 2, a damped loop), is registered from this file; the config accepts
it, the model runs it, the questions other modules ask of a recurrence answer for it, and it
passes every model test that iterates over the registry (tests/recurrences.py)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import test_loop_probes  # noqa: F401  (importing them lists their registry tests)
import test_model_blocks  # noqa: F401
import test_model_exit  # noqa: F401
import test_model_invariance  # noqa: F401
import test_model_transitions  # noqa: F401
from recurrences import REGISTRY_TESTS, loops, other_parameters
from scse_dist.config import load_config
from scse_dist.model import LoopedLM
from scse_dist.model.transitions import TRANSITIONS, Transition, Untied, register, transition_for
from scse_dist.typed_yaml import ConfigError


class Relaxed(Transition):
    """x_{t+1} = (x_t + Phi(x_t)) / 2: half a step towards Phi each time."""

    name = "relaxed"
    default_inject = "add"

    def step(self, core, x, ctx, t):
        return 0.5 * (x + core.phi_ctx(x, ctx, t))


class Pair(Untied):
    """A fixed stack of two distinct block groups whatever model.depth says (a second toy: one
    that does not loop, which the modules asking about loops must recognise without its name)."""

    name = "pair"

    @property
    def block_groups(self) -> int:
        return 2


@pytest.fixture
def toy():
    register(Relaxed)
    try:
        yield Relaxed
    finally:
        del TRANSITIONS[Relaxed.name]


def test_the_config_accepts_a_registered_recurrence_and_only_then(toy):
    cfg = load_config(None, ["model.recurrence=relaxed"])
    assert type(transition_for(cfg.model)) is Relaxed
    assert transition_for(cfg.model).resolved_inject == "add"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.recurrence=relax"])
    assert str(err.value).startswith(
        "model.recurrence: must be one of untied, looped, additive, scse, relaxed; got 'relax'")
    # its own answers: a loop without an anchor of its own
    assert loops("relaxed") and not transition_for(cfg.model).has_anchor
    with pytest.raises(ConfigError, match="model.anchor_scale: only scse has an anchor"):
        load_config(None, ["model.recurrence=relaxed", "model.anchor_scale=core_norm"])


def test_unregistered_it_is_refused_again(toy):
    del TRANSITIONS["relaxed"]
    try:
        with pytest.raises(ConfigError, match="model.recurrence: must be one of untied, looped, "
                                              "additive, scse; got 'relaxed'"):
            load_config(None, ["model.recurrence=relaxed"])
    finally:
        register(Relaxed)


def test_a_name_taken_is_refused(toy):
    class Other(Relaxed):
        pass

    with pytest.raises(ValueError, match="recurrence 'relaxed': already registered as Relaxed"):
        register(Other)


def test_the_model_runs_its_step(toy):
    torch.manual_seed(0)
    cfg = load_config(None, ["model.recurrence=relaxed", "model.d_model=32", "model.n_heads=2",
                             "model.vocab_size=64"])
    model = LoopedLM(cfg.model).eval()
    toks = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        s = model.source(toks)
        x, ctx = model.core.start(s)
        want = 0.5 * (x + model.core.phi(x, s, 0))
        assert torch.equal(model.core.step(x, ctx, 0), want)
        assert model(toks, depth=3).core_calls == 3


def test_what_other_modules_ask_answers_for_it(toy):
    from scse_dist.study.report import training_depth
    from scse_dist.train.dry_run import training_depths

    cfg = load_config(None, ["model.recurrence=relaxed", "train.max_steps=5",
                             "train.depth.kind=uniform", "train.depth.max=6"])
    depths = training_depths(cfg.model, cfg.train)
    assert len(depths) == 5 and all(2 <= d <= 6 for d in depths)
    assert training_depth(cfg.model, cfg.train) == 6  # a loop: the sampler's deepest T


def test_a_toy_without_a_loop_is_treated_as_one(toy):
    from scse_dist.study.collect import StudyRun
    from scse_dist.study.flags import FlagThresholds, flat_in_t
    from scse_dist.study.report import training_depth
    from scse_dist.train.callbacks.diagnostics import LoopDiagnosticsCallback
    from scse_dist.train.dry_run import training_depths

    register(Pair)
    try:
        cfg = load_config(None, ["model.recurrence=pair", "train.max_steps=3", "model.depth=6",
                                 "train.diagnostics_every=1"])
        # the depth it runs, not model.depth
        assert training_depths(cfg.model, cfg.train) == [2, 2, 2]
        assert training_depth(cfg.model, cfg.train) is None
        every_1 = LoopDiagnosticsCallback.Config(1)
        assert not LoopDiagnosticsCallback(every_1, cfg.train, cfg.model).for_run()
        flat = {"heldout": {d: {"ppl": 100.0} for d in (1, 2, 4)}}
        run = StudyRun("pair", 0, None, "final", Path("r"), config=cfg, results=flat)
        assert flat_in_t(run, FlagThresholds()) is None
        looped = StudyRun("looped", 0, None, "final", Path("r"), results=flat,
                          config=load_config(None, ["model.recurrence=looped"]))
        assert flat_in_t(looped, FlagThresholds()) == "heldout ppl flat for T >= 2 (spread 0.00%)"
        with pytest.raises(ConfigError, match="model.loop_stability: pair has no loop to keep "
                                              "moving; set it to 0"):
            load_config(None, ["model.recurrence=pair", "model.loop_stability=0.1"])
        assert LoopedLM(cfg.model).fixed_depth == 2
    finally:
        del TRANSITIONS["pair"]


def _call(test, monkeypatch, **kwargs):
    wanted = inspect.signature(test).parameters
    unknown = set(wanted) - set(kwargs) - {"monkeypatch"}
    assert not unknown, f"{test.__name__}: cannot supply {sorted(unknown)}"
    test(**kwargs, **({"monkeypatch": monkeypatch} if "monkeypatch" in wanted else {}))


@pytest.mark.parametrize("test, loops_only", REGISTRY_TESTS,
                         ids=[f"{t.__module__}.{t.__name__}" for t, _ in REGISTRY_TESTS])
def test_the_toy_passes_every_registry_test(toy, test, loops_only):
    runs = 0
    for kwargs in other_parameters(test):
        with pytest.MonkeyPatch.context() as monkeypatch:
            _call(test, monkeypatch, recurrence="relaxed", **kwargs)
        runs += 1
    assert runs >= 1


def test_the_registry_tests_cover_the_model_tests():
    names = {t.__name__ for t, _ in REGISTRY_TESTS}
    assert {"test_core_steps_through_its_transition",
            "test_multi_depth_readout_equals_separate_runs",
            "test_the_loop_trace_measures_the_forward_states",
            "test_flops_match_torch_flop_counter"} <= names
    assert len(REGISTRY_TESTS) >= 10


def test_added_inside_the_package_it_is_one_file(tmp_path, subprocess_env):
    """The same toy written into a copy of the package's transitions.py, and nowhere else: a run
    config with it loads, its model trains a step, the dry run and the study report ask it."""
    import shutil

    from conftest import REPO_ROOT

    copy = tmp_path / "scse_dist"
    shutil.copytree(REPO_ROOT / "scse_dist", copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = inspect.getsource(Relaxed)
    (copy / "model" / "transitions.py").write_text(
        (copy / "model" / "transitions.py").read_text() + "\n\n@register\n" + source)
    code = """
import torch
from scse_dist.config import load_config
from scse_dist.model import LoopedLM
from scse_dist.study.report import training_depth
from scse_dist.train.dry_run import training_depths
cfg = load_config(None, ['model.recurrence=relaxed', 'model.d_model=32', 'model.n_heads=2',
                         'model.vocab_size=64', 'train.max_steps=3'])
model = LoopedLM(cfg.model)
toks = torch.randint(0, 64, (2, 9))
model(toks, toks, depth=3).loss.backward()
print(type(model.core.transition).__name__, training_depths(cfg.model, cfg.train),
      training_depth(cfg.model, cfg.train))
"""
    env = dict(subprocess_env, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["Relaxed", "[4,", "4,", "4]", "4"]
