"""A study spec (YAML), read and checked (its runs, and the check that each run's config loads:
scse_dist.study.runs).

The format, with an example of every field, the run layout, the LR stages, `extends:` and
command-line overrides: docs/studies.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from scse_dist.config_paths import resolve_spec_paths
from scse_dist.resources import Resources
from scse_dist.study.factorial import parse_factorial
from scse_dist.study.prereg import parse_preregistration
from scse_dist.task_registry import TASKS
from scse_dist.typed_yaml import ConfigError, _read_yaml, apply_overrides, old_name_notice


class SpecError(ConfigError):
    """A study spec field is missing, mistyped or makes a run config that does not load; the
    message names the field. A ConfigError: the commands exit 2 on it."""


def default_report_metrics() -> dict[str, list[str]]:
    """task -> what the study report shows when the spec does not say."""
    return {name: list(t.study_metrics) for name, t in TASKS.items() if t.study_metrics}


@dataclass
class LrSweep:
    values: list[float]
    validation: str  # a JSONL/text corpus or a shard dir: what the rate is chosen on
    seed: int = 0
    steps: int = 0  # 0: the run config's train.max_steps
    extend_edges: bool = False  # a best rate at its grid's edge stops the study (choose_lrs)


@dataclass
class VariantRate:
    """What a variant's sweep sets: `key` over `values` (None: the study's lr.values)."""
    key: str = "train.optimizer.lr"
    values: Optional[list[float]] = None


@dataclass
class StudyEvals:
    tasks: list[str] = field(default_factory=lambda: ["heldout"])
    depths: list[int] = field(default_factory=lambda: [1, 2, 4])
    wikitext: Optional[str] = None
    lambada: Optional[str] = None
    data: dict[str, str] = field(default_factory=dict)  # like eval.data: task -> its file


@dataclass
class StudyValidation:
    """The validation text every choice is made on (scse_dist.study.validation scores it)."""
    path: str
    depth: int = 4  # the depth rates are chosen at (the sweep's score)


RUN_ORDERS = ("seed-major", "variant-major")


@dataclass
class Axis:
    key: str
    values: list[Any]
    variants: list[str]  # empty: every variant


@dataclass
class StudySpec:
    name: str
    base: str  # resolved against the spec file's directory
    variants: dict[str, dict[str, Any]]  # expanded variant name -> dotted overrides
    seeds: list[int]
    out: str = "studies"
    overrides: dict[str, Any] = field(default_factory=dict)
    lr: Optional[LrSweep] = None
    rates: dict[str, VariantRate] = field(default_factory=dict)  # variant -> its own sweep
    pairs: list[tuple[str, str]] = field(default_factory=list)
    exclude_flagged: bool = False
    evals: StudyEvals = field(default_factory=StudyEvals)
    order: str = "seed-major"
    resources: Resources = field(default_factory=Resources)  # each job's (formerly `slurm:`)
    report: dict[str, Any] = field(default_factory=dict)  # read by scse_dist.study.report
    validation: Optional[StudyValidation] = None
    preregistration: dict[str, Any] = field(default_factory=dict)  # scse_dist.study.prereg
    costing: dict[str, Any] = field(default_factory=dict)  # scse_dist.study.costing
    path: str = ""  # the spec file
    only: list[str] = field(default_factory=list)  # --variants: the runs started (empty: all)

    @property
    def study_dir(self) -> Path:
        return Path(self.out) / self.name

    def rate_key(self, variant: str) -> str:
        """The config field a variant's sweep chooses."""
        return self.rates.get(variant, VariantRate()).key

    def rate_values(self, variant: str) -> list[float]:
        own = self.rates.get(variant, VariantRate()).values
        if own is not None:
            return own
        assert self.lr is not None  # load_spec: a variant's own lr needs the study's lr:
        return self.lr.values


def _need(values: dict, key: str, kind: type | tuple, where: str) -> Any:
    if key not in values:
        raise SpecError(f"{where + ': ' if where else ''}missing field {key!r}")
    value = values[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise SpecError(f"{where + '.' if where else ''}{key}: expected "
                        f"{getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _check_keys(values: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(values) - allowed, key=str)
    if unknown:
        key = str(unknown[0])
        close = difflib.get_close_matches(key, sorted(allowed), n=1) or \
            [a for a in sorted(allowed) if a.startswith(key)][:1]  # gpus -> gpus_per_node
        hint = f" (did you mean {close[0]!r}?)" if close else \
            f"; known: {', '.join(sorted(allowed))}"
        raise SpecError(f"{where + '.' if where else ''}{unknown[0]}: unknown field{hint}")


def _check_report_metrics(metrics: Any) -> None:
    if not isinstance(metrics, dict):
        raise SpecError(f"report.metrics: expected {{task: [metric, ...]}}, got {metrics!r}")
    known = {name: t.metrics for name, t in TASKS.items() if t.study_metrics}  # quality tasks
    _check_keys(metrics, set(known), "report.metrics")
    for task, names in metrics.items():
        if not isinstance(names, list) or not names:
            raise SpecError(f"report.metrics.{task}: a non-empty list of metrics, got {names!r}")
        for name in names:
            if name not in known[task]:
                close = difflib.get_close_matches(str(name), known[task], n=1)
                hint = f"did you mean {close[0]!r}?" if close else \
                    f"{task} writes {', '.join(known[task])}"
                raise SpecError(f"report.metrics.{task}: {name!r} is not a metric of {task} "
                                f"({hint})")


def _positive_rates(rates: Any, where: str) -> list[float]:
    try:
        rates = [float(r) for r in rates]  # YAML reads `3e-4` as a string
    except (TypeError, ValueError):
        raise SpecError(f"{where}: a non-empty list of learning rates, got {rates!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise SpecError(f"{where}: a non-empty list of positive rates, got {rates!r}")
    return rates


def _variant_rate(body: Any, where: str) -> VariantRate:
    if not isinstance(body, dict):
        raise SpecError(f"{where}: expected {{key: train.<field>, values: [...]}}, got {body!r}")
    _check_keys(body, {"key", "values"}, where)
    key = body.get("key", "train.optimizer.lr")
    if not isinstance(key, str) or not key.startswith("train."):
        raise SpecError(f"{where}.key: a train.* field such as train.optimizer.muon_lr, got "
                        f"{key!r}")
    values = _positive_rates(body["values"], f"{where}.values") if "values" in body else None
    return VariantRate(key, values)


def _section(values: dict, key: str, cls: type) -> Any:
    """A spec section read into the dataclass `cls` (fields checked, ints typed)."""
    body = values.get(key) or {}
    if not isinstance(body, dict):
        raise SpecError(f"{key}: expected a mapping, got {body!r}")
    _check_keys(body, {f.name for f in dataclasses.fields(cls)}, key)
    for f in dataclasses.fields(cls):
        if f.type in (int, "int") and f.name in body and \
                (type(body[f.name]) is not int or body[f.name] < 0):
            raise SpecError(f"{key}.{f.name}: expected a whole number >= 0, got {body[f.name]!r}")
    return cls(**body)


def _expand_variants(variants: dict, axes: list[Axis]) -> dict[str, tuple[str, tuple, dict]]:
    """{expanded name: (variant, axis-value suffixes, overrides)}, e.g. scse-deeploop."""
    out: dict[str, tuple[str, tuple, dict]] = {}
    for name, over in variants.items():
        mine = [a for a in axes if not a.variants or name in a.variants]
        for combo in itertools.product(*[a.values for a in mine]):
            # a string value names itself; any other is its field's name and value: depth8
            suffix = tuple(v if isinstance(v, str) else f"{a.key.split('.')[-1]}{v}"
                           for a, v in zip(mine, combo))
            out["-".join([name, *suffix])] = \
                (name, suffix, {**over, **{a.key: v for a, v in zip(mine, combo)}})
    return out


BASELINE = "additive"  # the variant every other is compared with unless the spec names pairs


def default_pairs(variants: dict[str, tuple[str, tuple]]) -> list[tuple[str, str]]:
    """The pairs when a spec (or a study.yaml) names none: each variant against `additive` with the
    same axis values, else the first additive one. `variants`: name -> (spec variant, suffixes)."""
    baseline = {suffix: full for full, (name, suffix) in variants.items() if name == BASELINE}
    if not baseline:
        return []
    return [(full, baseline.get(suffix, next(iter(baseline.values()))))
            for full, (name, suffix) in variants.items() if name != BASELINE]


# costing's default MFUs: scse_dist.study.costing prints GPU-hours at each
DEFAULT_MFU = (0.40, 0.25)


def parse_costing(body: Any) -> dict[str, Any]:
    """{gpus: [...], mfu: [...]} checked ({} when absent); ConfigError naming the field."""
    if body is None:
        return {}
    if not isinstance(body, dict) or set(body) - {"gpus", "mfu"}:
        raise ConfigError(f"costing: expected {{gpus: [8, 64], mfu: [0.4, 0.25]}}, got {body!r}")
    gpus, mfu = body.get("gpus", []), body.get("mfu", list(DEFAULT_MFU))
    if not isinstance(gpus, list) or not all(type(g) is int and g >= 1 for g in gpus):
        raise ConfigError(f"costing.gpus: a list of GPU counts >= 1, got {gpus!r}")
    if not isinstance(mfu, list) or not mfu or \
            not all(isinstance(m, (int, float)) and 0 < m <= 1 for m in mfu):
        raise ConfigError(f"costing.mfu: a non-empty list of fractions in (0, 1], got {mfu!r}")
    return {"gpus": gpus, "mfu": [float(m) for m in mfu]}


def parse_spec(values: Any, file: str = "<spec>") -> StudySpec:
    """Check and expand a spec mapping; SpecError naming the field (`file: variants.x: ...`)."""
    try:
        return _parse(values, file)
    except SpecError as exc:
        msg = str(exc)
        raise SpecError(msg if msg.startswith(file) else f"{file}: {msg}") from None


def _resources_key(values: dict) -> str:
    """`resources:`, or the old name `slurm:` (read for now, with a notice; not both)."""
    if "slurm" not in values:
        return "resources"
    if "resources" in values:
        raise SpecError("slurm: is the old name of resources:; give one of them")
    old_name_notice("the spec's slurm: section", "resources:", "scse-study")
    return "slurm"


def _parse(values: Any, file: str) -> StudySpec:
    if not isinstance(values, dict):
        raise SpecError("a study spec is a mapping at the top level")
    _check_keys(values, {"name", "out", "base", "overrides", "variants", "seeds", "axes", "lr",
                         "pairs", "exclude_flagged", "evals", "order", "resources", "slurm",
                         "report", "validation", "preregistration", "costing"}, "")
    name = _need(values, "name", str, "")
    if not name or "/" in name:
        raise SpecError(f"name: a non-empty study name without '/', got {name!r}")
    base = str(Path(file).parent / _need(values, "base", str, ""))
    variants: dict[str, dict] = {}
    own_rates: dict[str, VariantRate] = {}
    for vname, body in _need(values, "variants", dict, "").items():
        if not isinstance(body, dict) or set(body) - {"overrides", "lr"}:
            raise SpecError(f"variants.{vname}: expected {{overrides: {{dotted.key: value}}}} "
                            "and optionally lr: {key: ..., values: [...]}")
        over = body.get("overrides") or {}
        if not isinstance(over, dict):
            raise SpecError(f"variants.{vname}.overrides: expected a mapping")
        variants[str(vname)] = over
        if body.get("lr") is not None:
            own_rates[str(vname)] = _variant_rate(body["lr"], f"variants.{vname}.lr")
    if not variants:
        raise SpecError("variants: name at least one variant")
    seeds = values.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise SpecError(f"seeds: a non-empty list of distinct integers, got {seeds!r}")
    axes = []
    for key, body in (values.get("axes") or {}).items():
        body = body if isinstance(body, dict) else {"values": body}
        _check_keys(body, {"values", "variants"}, f"axes.{key}")
        vals, only = body.get("values"), body.get("variants") or []
        if not isinstance(vals, list) or not vals:
            raise SpecError(f"axes.{key}: a non-empty list of values, got {vals!r}")
        stray = [v for v in only if v not in variants]
        if stray:
            raise SpecError(f"axes.{key}.variants: {stray[0]!r} is not a variant")
        axes.append(Axis(str(key), vals, list(only)))
    expanded = _expand_variants(variants, axes)
    valid = None
    if values.get("validation") is not None:
        _need(_need(values, "validation", dict, ""), "path", str, "validation")
        valid = _section(values, "validation", StudyValidation)
        if not isinstance(valid.path, str) or valid.depth < 1:
            raise SpecError(f"validation: a path and a depth >= 1, got {values['validation']!r}")
    lr = None
    if values.get("lr") is not None:
        body = _need(values, "lr", dict, "")
        _check_keys(body, {"values", "validation", "seed", "steps", "extend_edges"}, "lr")
        sweep_rates = _positive_rates(body.get("values"), "lr.values")
        # the study's validation text, unless the sweep names its own
        validation = valid.path if valid and "validation" not in body else \
            _need(body, "validation", str, "lr")
        lr = LrSweep(sweep_rates, validation, int(body.get("seed", 0)),
                     int(body.get("steps", 0)), bool(body.get("extend_edges", False)))
    if own_rates and lr is None:
        raise SpecError(f"variants.{next(iter(own_rates))}.lr: needs the study's lr: section "
                        "(validation, seed, steps)")
    pairs = values.get("pairs")
    if pairs is None:
        pairs = default_pairs({full: (name, suffix)
                               for full, (name, suffix, _) in expanded.items()})
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise SpecError(f"pairs[{i}]: expected [variant, baseline], got {pair!r}")
        for v in pair:
            if not isinstance(v, str) or v not in expanded:
                raise SpecError(f"pairs[{i}]: {v!r} is not a variant; known: {', '.join(expanded)}")
    evals = _section(values, "evals", StudyEvals)
    if valid:  # the final runs score it in their own jobs, like the test tasks
        evals.tasks = [*evals.tasks, *(["validation"] if "validation" not in evals.tasks else [])]
        evals.data = {**evals.data, "validation": valid.path}
    for task in evals.tasks:
        if not isinstance(task, str) or task not in TASKS:
            raise SpecError(f"evals.tasks: {task!r} is not one of {', '.join(TASKS)}")
    overrides = values.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise SpecError("overrides: expected a mapping of dotted keys")
    exclude = values.get("exclude_flagged", False)
    if not isinstance(exclude, bool):
        raise SpecError(f"exclude_flagged: expected true or false, got {exclude!r}")
    order = values.get("order", "seed-major")
    if order not in RUN_ORDERS:
        raise SpecError(f"order: one of {', '.join(RUN_ORDERS)}, got {order!r}")
    resources = _section(values, _resources_key(values), Resources)
    if resources.problem():
        raise SpecError(f"{_resources_key(values)}: {resources.problem()}")
    report = values.get("report") or {}
    if not isinstance(report, dict):
        raise SpecError(f"report: expected a mapping, got {report!r}")
    _check_keys(report, {"metrics", "factorial"}, "report")
    _check_report_metrics(report.get("metrics") or {})
    try:
        parse_factorial(report.get("factorial"))
        prereg = parse_preregistration(values.get("preregistration"), list(expanded))
        costing = parse_costing(values.get("costing"))
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    # `out:` is relative to the spec file, like `base:` (the default, ./studies, to the cwd)
    out = (os.path.normpath(Path(file).parent / _need(values, "out", str, "")) if "out" in values
           else "studies")
    rates = {full: own_rates[vname] for full, (vname, _, _) in expanded.items()
             if vname in own_rates}
    spec = StudySpec(name=name, base=base, variants={k: v[2] for k, v in expanded.items()},
                     seeds=seeds, out=out, overrides=overrides, lr=lr, rates=rates,
                     pairs=[tuple(p) for p in pairs], exclude_flagged=exclude, evals=evals,
                     order=order, resources=resources, report=report, validation=valid,
                     preregistration=prereg, costing=costing, path=file)
    return spec


# Top-level keys holding paths relative to the spec file that sets them, and the mappings whose
# keys are dotted run-config fields (an override into one takes the rest of its key whole).
SPEC_PATHS = ("base", "out")
DOTTED_MAPPINGS = ("overrides", "variants.*.overrides")


def load_spec(path: str | Path, overrides: list[str] | None = None) -> StudySpec:
    """Read a spec file (and what it `extends:`), then typed_yaml's `key=value` overrides;
    `out=` on the command line is relative to where it is typed."""
    p = Path(path)
    given = [f"out={Path(item.split('=', 1)[1]).resolve()}" if item.startswith("out=") else item
             for item in overrides or []]
    try:
        values = _read_yaml(p, kind="study spec", overlay="extends", file_relative=SPEC_PATHS,
                            normalize=resolve_spec_paths)
        apply_overrides(values, given, DOTTED_MAPPINGS)
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    return parse_spec(values, str(p))
