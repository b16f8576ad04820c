"""Property tests of the config reader (hypothesis): any mapping of known fields with values of
any type, unknown keys or sections that are not mappings gives a config or exit 2 with one line
(`scse-train: config error: ...`), never a traceback. In-process (config_from_dict under the CLI's
cli_main) for speed, plus one real `scse-train` on such a file."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import subprocess
import typing

import yaml
from hypothesis import assume, given, settings, strategies as st

from conftest import console_script
from scse_dist.cli_errors import EXIT_CONFIG, cli_main
from scse_dist.config import RunConfig, config_from_dict
from scse_dist.typed_yaml import apply_overrides

# repeatable: the same examples every run, none saved in the checkout
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def _fields(cls: type, prefix: tuple[str, ...] = ()) -> tuple[list, list]:
    """(leaf paths with their types, section paths) of a config dataclass, recursively."""
    leaves, sections = [], []
    for name, tp in typing.get_type_hints(cls).items():
        path = (*prefix, name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            sections.append(path)
            more_leaves, more_sections = _fields(tp, path)
            leaves += more_leaves
            sections += more_sections
        else:
            leaves.append((path, tp))
    return leaves, sections


LEAVES, SECTIONS = _fields(RunConfig)
SCALARS = [path for path, tp in LEAVES if tp in (bool, int, float)]  # a list or mapping is wrong

# no subnormals: conftest's cpu_settings flushes them (torch.set_flush_denormal), which
# hypothesis refuses to draw floats under
FLOATS = st.floats(allow_subnormal=False)
any_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | FLOATS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6)
containers = st.lists(any_value, min_size=1, max_size=2) | \
    st.dictionaries(st.text(min_size=1, max_size=6), any_value, min_size=1, max_size=2)

# a key the one line can show (whitespace and control characters collapse in it)
KEYS = st.text(st.characters(blacklist_categories=("Z", "C")), min_size=1, max_size=12)


def nest(items: list[tuple[tuple[str, ...], object]]) -> dict:
    """{('a', 'b'): v} -> {'a': {'b': v}}; a later item wins where paths clash."""
    out: dict = {}
    for path, value in items:
        node = out
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    return out


def read_as_the_cli(values: dict, overrides: tuple[str, ...] = ()) -> tuple[int, str]:
    """config_from_dict(values) (with `key=value` overrides: load_config's path) under
    scse-train's error handling: (exit status, stderr without the once-per-process notices
    that an old name such as `train.optimizer: muon` is read, so the result does not depend on
    which test ran first). A bug (any error but a config error) raises, with its traceback."""
    @cli_main("scse-train")
    def main(argv=None) -> int:
        config_from_dict(apply_overrides(values, list(overrides)))
        return 0

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main()
    lines = err.getvalue().splitlines(keepends=True)
    return status, "".join(line for line in lines if not line.startswith("config: notice: "))


def refused(values: dict, field: str) -> None:
    status, err = read_as_the_cli(values)
    assert status == EXIT_CONFIG, values
    assert err.count("\n") == 1 and err.startswith(f"scse-train: config error: {field}"), err


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([p for p, _ in LEAVES]), any_value), max_size=5))
def test_known_fields_with_values_of_any_type_read_or_are_one_line(items):
    status, err = read_as_the_cli(nest(items))
    assert (status, err) == (0, "") or \
        (status == EXIT_CONFIG and err.count("\n") == 1
         and err.startswith("scse-train: config error: ")), err


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([p for p, _ in LEAVES] + SECTIONS),
                          st.text(max_size=12)), max_size=4))
def test_command_line_overrides_of_any_text_read_or_are_one_line(items):
    overrides = tuple(f"{'.'.join(path)}={text}" for path, text in items)
    status, err = read_as_the_cli({}, overrides)
    assert (status, err) == (0, "") or \
        (status == EXIT_CONFIG and err.count("\n") == 1
         and err.startswith("scse-train: config error: ")), (overrides, err)


@SETTINGS
@given(st.sampled_from(SCALARS), containers)
def test_a_list_or_mapping_for_a_number_or_flag_names_the_field(path, value):
    refused(nest([(path, value)]), ".".join(path))


@SETTINGS
@given(st.sampled_from([(), *SECTIONS]), KEYS, any_value)
def test_an_unknown_key_at_any_level_names_it(section, key, value):
    known = {p[len(section)] for p, _ in LEAVES if p[:len(section)] == section and
             len(p) > len(section)} | {p[len(section)] for p in SECTIONS
                                       if p[:len(section)] == section and len(p) > len(section)}
    assume(key not in known and key not in ("resources", "slurm"))  # slurm: renamed
    refused(nest([((*section, key), value)]), ".".join((*section, key)))


@SETTINGS
@given(st.sampled_from(SECTIONS),
       st.booleans() | st.integers() | FLOATS | st.text(max_size=8) |
       st.lists(any_value, max_size=2))
def test_a_section_that_is_not_a_mapping_names_it(section, value):
    refused(nest([(section, value)]), ".".join(section))


def test_scse_train_reads_a_badly_nested_file_as_one_line_and_exit_2(tmp_path, subprocess_env):
    path = tmp_path / "nested.yaml"
    path.write_text(yaml.safe_dump({"model": {"d_model": {"value": 64}}, "train": 5}))
    out = subprocess.run(console_script("scse-train") + ["--config", str(path)], cwd=tmp_path,
                         env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert out.stderr == (f"scse-train: config error: model.d_model: expected an integer, got "
                          f"{{'value': 64}} (in {path})\n")
