"""Exit rules (scse_dist/model/exit_rules.py): parsing and per-token decisions on built tensors."""

import math

import pytest
import torch

from scse_dist.model import ExitRule, parse_exit_rule


def test_parse_forms_and_round_trip():
    assert parse_exit_rule("fixed") == ExitRule("fixed", 0.0, 1, None)
    assert parse_exit_rule("kl:0.01") == ExitRule("kl", 0.01, 1, None)
    assert parse_exit_rule("motion:0.02,min=2,max=32") == ExitRule("motion", 0.02, 2, 32)
    assert parse_exit_rule("fixed,max=8") == ExitRule("fixed", 0.0, 1, 8)
    for text in ("fixed", "kl:0.01", "motion:0.02,min=2,max=32", "fixed,max=8"):
        assert str(parse_exit_rule(text)) == text
    assert parse_exit_rule("kl:0.5").needs_readout and \
        not parse_exit_rule("motion:0.5").needs_readout
    assert parse_exit_rule("motion:0.1").cap(16) == 16
    assert parse_exit_rule("motion:0.1,max=4").cap(16) == 4


@pytest.mark.parametrize("text, names", [
    ("speed:0.1", "unknown kind 'speed'"),
    ("motion", "numeric threshold"),
    ("motion:abc", "'motion:abc'"),
    ("fixed:0.1", "fixed takes no threshold"),
    ("kl:0.1,mx=3", "unknown option 'mx=3'"),
    ("kl:0.1,max=x", "max must be an integer"),
    ("kl:-1", "threshold must be >= 0"),
    ("kl:0.1,min=0", "min must be >= 1"),
    ("kl:0.1,min=4,max=2", "max must be >= min (4)"),
])
def test_parse_errors_name_the_bad_part(text, names):
    with pytest.raises(ValueError) as err:
        parse_exit_rule(text)
    assert names in str(err.value) and repr(text) in str(err.value)


def _deviations():
    """Three tokens: relative motion 0.1, 0.5, and a zero row that stays at its anchor."""
    d_prev = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]]])  # norms 5, 1, 0
    d_new = d_prev + torch.tensor([[[0.3, 0.4], [0.0, 0.5], [0.0, 0.0]]])
    return d_prev, d_new


def test_motion_is_relative_to_the_deviation():
    d_prev, d_new = _deviations()
    assert ExitRule("motion", 0.2).exited(1, d_prev, d_new).tolist() == [[True, False, True]]
    assert ExitRule("motion", 0.6).exited(1, d_prev, d_new).tolist() == [[True, True, True]]
    # threshold 0 never exits early, not even the unmoved zero row (strict <)
    assert ExitRule("motion", 0.0).exited(1, d_prev, d_new).tolist() == [[False] * 3]
    # a row leaving the anchor has moved infinitely far relative to it
    leaving = torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[1e-6, 0.0]]])
    assert not ExitRule("motion", 1e9).exited(1, *leaving).item()


def test_min_and_max_steps():
    d_prev, d_new = _deviations()
    rule = ExitRule("motion", 0.2, min_steps=3, max_steps=5)
    assert rule.exited(2, d_prev, d_new).tolist() == [[False] * 3]  # before min: never
    assert rule.exited(3, d_prev, d_new).tolist() == [[True, False, True]]
    assert rule.exited(5, d_prev, d_new).tolist() == [[True] * 3]  # at max: always
    fixed = ExitRule("fixed", max_steps=4)
    assert fixed.exited(3, d_prev, d_prev).tolist() == [[False] * 3]  # not even without motion
    assert fixed.exited(4, d_prev, d_new).tolist() == [[True] * 3]
    assert ExitRule("fixed").exited(100, d_prev, d_prev).tolist() == [[False] * 3]
    assert ExitRule("fixed").with_max(7).max_steps == 7
    assert ExitRule("fixed", max_steps=3).with_max(7).max_steps == 3


def test_kl_between_consecutive_readouts():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    kl_second = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(p || q), ~0.368
    d = torch.zeros(2, 4)
    rule = ExitRule("kl", kl_second + 1e-4)
    assert rule.exited(1, d, d, p.log(), q.log()).tolist() == [True, True]
    assert ExitRule("kl", kl_second - 1e-4).exited(1, d, d, p.log(), q.log()).tolist() == \
        [True, False]
    with pytest.raises(ValueError, match="log-probs"):
        rule.exited(1, d, d)
