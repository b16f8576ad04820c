"""The recurrences the model tests run: every one in the registry (scse_dist.model.transitions),
none named, so a recurrence added there runs through them unchanged.

A test parametrised with `@over_recurrences()` is also listed in REGISTRY_TESTS, which
tests/test_toy_extensions.py replays with a recurrence it registers itself (the registry is read
when a test module is collected, before that test has registered anything).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import pytest

from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import TRANSITIONS

# (test function, loops_only) for every test parametrised over the registry
REGISTRY_TESTS: list[tuple[Callable, bool]] = []


def loops(name: str) -> bool:
    """Whether recurrence `name` runs at any depth (its Transition's answer, at the defaults)."""
    return TRANSITIONS[name](ModelConfig(recurrence=name)).loops


def recurrences(loops_only: bool = False) -> list[str]:
    """The registered recurrences (only those that loop: `loops_only`), in registry order."""
    return [name for name in TRANSITIONS if not loops_only or loops(name)]


def over_recurrences(loops_only: bool = False) -> Callable[[Callable], Callable]:
    """pytest.mark.parametrize("recurrence", recurrences(loops_only)), and the test recorded."""
    def mark(test: Callable) -> Callable:
        REGISTRY_TESTS.append((test, loops_only))
        return pytest.mark.parametrize("recurrence", recurrences(loops_only))(test)
    return mark


def other_parameters(test: Callable) -> Iterator[dict[str, Any]]:
    """Every combination of a test's parametrize marks other than `recurrence`."""
    grids = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize" or mark.args[0] == "recurrence":
            continue
        names = [n.strip() for n in mark.args[0].split(",")]
        grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    for combo in itertools.product(*grids):
        yield {k: v for part in combo for k, v in part.items()}
