"""The study report: seeds aggregated per variant and depth, paired comparisons with a verdict,
extrapolation ratios, pathology flags, the learning-rate choice, the frontier plots, and a
factorial's effects (spec report.factorial). What it writes and shows: docs/evaluation.md;
the command is `scse-report --study STUDY_DIR` (scse_dist.study.report_cli).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, Optional

from scse_dist.atomic import output_dir
from scse_dist.config import RunConfig
from scse_dist.model.config import ModelConfig
from scse_dist.model.transitions import transition_for
from scse_dist.study import factorial, prereg
from scse_dist.study.collect import Study, finite, load_study
from scse_dist.study.compare import aggregate, paired, values_by_depth, verdict
from scse_dist.study.flags import Flag, run_flags, unigram_entropy
from scse_dist.study.plan import choice_markdown
from scse_dist.study.plots import (
    TRAINING_DIAGNOSTICS,
    diagnose_plot,
    frontier_plot,
    training_diagnostics_plot,
)
from scse_dist.study.spec import default_report_metrics
from scse_dist.study.stats import Interval
from scse_dist.task_registry import TASKS
from scse_dist.train.config import TrainConfig

DIAGNOSE_NORMS = ("deviation_norm", "motion_norm", "bias_norm")
INTERVAL_METHOD = ("95% Student-t intervals over seeds: mean ± t(0.975, n-1)·s/√n "
                   "(s the sample standard deviation); no bootstrap")
REPORT_NAME = "report.md"

def flops_at(model: ModelConfig, depth: int, seq_len: int) -> Optional[float]:
    """Training FLOPs per token over the unrolled depth at loop depth T; None where undefined."""
    from scse_dist.model.flops import flops_per_token

    try:
        return flops_per_token(model, depth, seq_len)
    except ValueError:  # e.g. an untied model asked at another depth than its fixed one
        return None


def training_depth(m: ModelConfig, train: TrainConfig) -> Optional[int]:
    """The deepest T the run trained at (the depth sampler's max, else model.depth); None for a
    model that does not loop."""
    d = train.depth
    if not transition_for(m).loops:
        return None
    if d.kind == "uniform":
        return d.max or 2 * m.depth
    return d.max if d.kind == "poisson_lognormal" and d.max else m.depth


def reference_depth(depths, t_train: Optional[int]) -> Optional[int]:
    """The extrapolation ratio's reference: the deepest evaluated T within the training range."""
    within = [d for d in depths if t_train is not None and d <= t_train]
    return max(within) if within else None


def _cell(iv: Optional[Interval]) -> str:
    if iv is None:
        return ""
    if iv.std is None:
        return f"{iv.mean:.4g} (n=1)"
    return f"{iv.mean:.4g} ± {iv.half_width:.3g} (sd {iv.std:.3g}, n={iv.n})"


def _number(value: Optional[float], fmt: str = ".4g") -> str:
    return "" if value is None else format(value, fmt)


def _depth_table(header: str, rows: list[tuple[str, dict[int, Any]]], fmt=_cell,
                 extra: Optional[tuple[str, list[str]]] = None) -> list[str]:
    depths = sorted({d for _, cells in rows for d in cells})
    head = f"| {header} | " + " | ".join(f"T={d}" for d in depths) + " |" + \
        (f" {extra[0]} |" if extra else "")
    lines = [head, "|---|" + "---:|" * len(depths) + ("---|" if extra else "")]
    for i, (name, cells) in enumerate(rows):
        line = f"| {name} | " + " | ".join(fmt(cells.get(d)) for d in depths) + " |"
        lines.append(line + (f" {extra[1][i]} |" if extra else ""))
    return lines


class StudyReport:
    """Everything the report shows, computed once from a loaded study."""

    def __init__(self, study: Study) -> None:
        self.study = study
        self.finished = [r for r in study.runs if r.missing is None]
        self.missing = [r for r in study.runs if r.missing is not None]
        self.entropy = {}
        self.flags: dict[str, list[Flag]] = {}
        for run in self.finished:
            entropy = None
            if run.config is not None:
                entropy = unigram_entropy(run.config.data.path, run.config.model.vocab_size)
                self.entropy[entropy.source] = entropy.nats
            # a final run's other seeds (a sweep run's neighbours differ in lr, not seed)
            peers = [r for r in self.finished if run.stage == "final" and r is not run
                     and (r.variant, r.stage) == (run.variant, "final")]
            self.flags[run.label] = run_flags(run, entropy, peers=peers)
        final = [r for r in self.finished if r.stage == "final"]
        self.excluded = [r for r in final if study.exclude_flagged
                         and any(f.excludes for f in self.flags[r.label])]
        self.included = [r for r in final if r not in self.excluded]
        self.variants = [v for v in study.variants if any(r.variant == v for r in self.included)]
        # task -> the metrics shown: the spec's report.metrics over the defaults
        self.metrics = {**default_report_metrics(),
                        **((study.spec.get("report") or {}).get("metrics") or {})}
        self.table = aggregate(self.included, self.variants, self.metrics)
        keys = [(a, b, t, m) for a, b in study.pairs for t, names in self.metrics.items()
                for m in names]
        self.pairs = {k: v for k in keys if (v := paired(self.included, *k))}
        self.prereg = study.spec.get("preregistration") or {}
        self.declared = {(*c["pair"], c["task"], c["metric"], c["depth"]):
                         paired(self.included, c["pair"][0], c["pair"][1], c["task"],
                                c["metric"]).get(c["depth"])
                         for _, c in prereg.comparisons(self.prereg)}
        self.design = factorial.parse_factorial((study.spec.get("report") or {}).get("factorial"))
        self.effects, self.factorial_note = factorial.effects(
            self.design, self.included, self.metrics) if self.design else ({}, "")

    def marked(self, variant: str) -> str:
        """The variant's name, marked with how many of its aggregated runs are flagged."""
        n = sum(1 for r in self.included if r.variant == variant and self.flags.get(r.label))
        return f"{variant} ({n} flagged)" if n else variant

    def config_of(self, variant: str) -> Optional[RunConfig]:
        return next((r.config for r in self.included if r.variant == variant and r.config), None)

    def extrapolation(self) -> list[tuple[str, int, dict[int, float]]]:
        """(label, reference depth, {T > ref: mean(T) / mean(ref)}), ref as reference_depth."""
        rows = []
        for (variant, task, metric), by_depth in self.table.items():
            cfg = self.config_of(variant)
            t_train = training_depth(cfg.model, cfg.train) if cfg else None
            ref = reference_depth(by_depth, t_train)
            if ref is None:
                continue
            base = by_depth[ref].mean
            ratios = {d: iv.mean / base for d, iv in by_depth.items() if d > ref and base}
            if ratios:
                rows.append((f"{variant} {task} {metric} (trained to T={t_train})", ref, ratios))
        return rows

    def frontier_series(self, x: str) -> dict:
        """The first reported metric of each task (one panel per task), per variant."""
        series: dict = {}
        for (variant, task, metric), by_depth in self.table.items():
            if metric != self.metrics[task][0]:
                continue
            cfg = self.config_of(variant)
            points = []
            for depth, iv in by_depth.items():
                pos = depth if x == "depth" else (
                    flops_at(cfg.model, depth, cfg.data.seq_len) if cfg else None)
                if pos is not None:
                    points.append((pos, iv))
            if points:
                series.setdefault(f"{task} {metric}", {})[variant] = points
        return series

    def diagnose_series(self) -> dict:
        out: dict = {}
        for variant in self.variants:
            runs = [r for r in self.included if r.variant == variant]
            norms = {name: [(d, sum(v.values()) / len(v)) for d, v in sorted(by_depth.items())]
                     for name in DIAGNOSE_NORMS
                     if (by_depth := values_by_depth(runs, "diagnose", name))}
            if norms:
                out[variant] = norms
        return out

    def training_diagnostics_series(self) -> dict:
        """{variant: {run label: {metric: [(step, value)]}}} of the logged loop diagnostics."""
        out: dict = {}
        for run in self.included:
            series = {m: [(r["step"], r[m]) for r in run.metrics
                          if "step" in r and finite(r.get(m)) is not None]
                      for m in TRAINING_DIAGNOSTICS}
            if any(series.values()):
                out.setdefault(run.variant, {})[run.label] = series
        return out

    def collapsed(self) -> set[str]:
        """Labels of the runs flagged loop inactive (a loop fallen onto its anchor)."""
        return {label for label, flags in self.flags.items()
                if any(f.name == "loop inactive" for f in flags)}

    def markdown(self, images: dict[str, str]) -> str:
        s, lines = self.study, [f"# Study report: {self.study.name}", ""]
        lines += [f"Study dir: `{s.dir}`. {len(s.runs)} runs: {len(self.finished)} finished, "
                  f"{len(self.missing)} missing; {len(self.included)} final-stage runs in the "
                  "aggregate.",
                  "", f"Intervals: {INTERVAL_METHOD}.", ""]
        lines[2:2] = prereg.markdown(self.prereg, self.declared)  # first, before any result
        if self.missing:
            lines += ["## Missing or failed runs", ""]
            lines += [f"- {r.label} ({r.stage}, `{r.run_dir}`): {r.missing}" for r in self.missing]
            lines.append("")
        lines += choice_markdown(s.lr_choice)
        lines += self._flag_lines()
        for task, metric in self._task_metrics():
            rows = [(self.marked(v), self.table[(v, task, metric)]) for v in self.variants
                    if (v, task, metric) in self.table]
            if rows:
                better = TASKS[task].better(metric)
                lines += [f"## {task} {metric} ({better} is better): mean ± 95% half-width over "
                          "seeds", ""]
                lines += _depth_table("variant", rows) + [""]
        if self.pairs:
            lines += ["## Paired comparisons (A - B, per seed, matched by seed)", ""]
            for task, metric in self._task_metrics():
                mine = [(a, b, d) for (a, b, t, m), d in self.pairs.items()
                        if (t, m) == (task, metric)]
                if mine:
                    rows = [(f"{a} - {b}", d) for a, b, d in mine]
                    verdicts = [f"{a} {verdict(d, metric in TASKS[task].higher_is_better)}"
                                for a, b, d in mine]
                    lines += [f"### {task} {metric}", ""]
                    lines += _depth_table("pair", rows, extra=("verdict", verdicts)) + [""]
        if self.design:
            lines += factorial.markdown(self.design, self.effects, self.factorial_note)
        extrapolation = self.extrapolation()
        if extrapolation:
            lines += ["## Extrapolation ratio: metric at T / metric at the training depth", "",
                      "Means over seeds; the reference is the deepest evaluated T within the "
                      "training range (ref).", ""]
            lines += _depth_table("variant task",
                                  [(f"{n}, ref T={t}", r) for n, t, r in extrapolation],
                                  fmt=lambda v: "" if v is None else f"{v:.3f}") + [""]
        lines += self._run_lines()
        lines += ["## Plots", ""] + [f"![{name}]({Path(p).name})" for name, p in images.items()]
        return "\n".join(lines) + "\n"

    def _run_lines(self) -> list[str]:
        """A row per aggregated run: the first task's first metric per depth, its extrapolation
        ratio, its last logged loop diagnostics and its flags."""
        task = next(iter(self.metrics), None)
        runs = [r for r in self.included if task in r.results]
        if task is None or not runs:
            return []
        metric = self.metrics[task][0]
        depths = sorted({d for r in runs for d in r.results[task]})
        lines = [f"## Per run: {task} {metric}, the last training diagnostics, flags", "",
                 "ratio: the metric at the deepest T over that at the deepest T within the "
                 "training range; D_kept, R/rho and gain: the last logged diag/D_kept, "
                 "diag/anchor_over_scale, diag/loop_gain.", "",
                 "| run | " + " | ".join(f"T={d}" for d in depths)
                 + " | ratio | D_kept | R/rho | gain | flags |",
                 "|---|" + "---:|" * (len(depths) + 4) + "---|"]
        for run in runs:
            values = {d: finite(row.get(metric)) for d, row in run.results[task].items()}
            cfg = run.config
            ref = reference_depth(values, training_depth(cfg.model, cfg.train) if cfg else None)
            at_ref = values[ref] if ref is not None and max(values) > ref else None
            deepest = values[max(values)]
            ratio = deepest / at_ref if at_ref and deepest else None
            last = {m: next((finite(r.get(m)) for r in reversed(run.metrics)
                             if finite(r.get(m)) is not None), None) for m in TRAINING_DIAGNOSTICS}
            cells = [_number(values.get(d)) for d in depths] + [_number(ratio, ".3f")]
            cells += [_number(last[m], ".3g") for m in TRAINING_DIAGNOSTICS]
            flags = ", ".join(f.name for f in self.flags.get(run.label, []))
            lines.append(f"| {run.label} | " + " | ".join(cells) + f" | {flags} |")
        return lines + [""]

    def _task_metrics(self) -> list[tuple[str, str]]:
        return [(task, metric) for task, names in self.metrics.items() for metric in names]

    def _flag_lines(self) -> list[str]:
        flagged = [(r, self.flags[r.label]) for r in self.finished if self.flags.get(r.label)]
        sources = "; ".join(f"{src}: {nats:.3f} nats" for src, nats in self.entropy.items())
        lines = ["## Pathology flags", "",
                 f"Plateau reference: {sources or 'no config to read'}.", ""]
        if not flagged:
            return lines + ["No run is flagged.", ""]
        action = "excluded from" if self.study.exclude_flagged else "included in (and marked)"
        lines += [f"Flagged runs are {action} the aggregate (spec exclude_flagged="
                  f"{str(self.study.exclude_flagged).lower()}).", "",
                  "| run | stage | flag | detail |",
                  "|---|---|---|---|"]
        for run, flags in flagged:
            lines += [f"| {run.label} | {run.stage} | {f.name} | {f.detail} |" for f in flags]
        return lines + [""]

    def numbers(self) -> dict:
        """aggregate.json: the report's numbers for scripts and the project notes."""
        return {"study": self.study.name, "interval": INTERVAL_METHOD,
                "missing": {r.label: r.missing for r in self.missing},
                "flags": {k: [asdict(f) for f in v] for k, v in self.flags.items() if v},
                "excluded": [r.label for r in self.excluded],
                "aggregate": {f"{v}/{t}/{m}": {str(d): asdict(iv) for d, iv in by_d.items()}
                              for (v, t, m), by_d in self.table.items()},
                "paired": {f"{a} - {b}/{t}/{m}": {
                    "verdict": verdict(d, m in TASKS[t].higher_is_better),
                    "depths": {str(k): asdict(iv) for k, iv in d.items()}}
                    for (a, b, t, m), d in self.pairs.items()},
                "factorial": factorial.numbers(self.effects),
                "preregistration": {f"{a} - {b}/{t}/{m}/T={d}": None if iv is None else asdict(iv)
                                    for (a, b, t, m, d), iv in self.declared.items()}}


def _log_to_wandb(report: StudyReport, out: Path, mode: Literal["offline", "online", "disabled"],
                  images: dict[str, str]) -> None:
    from scse_dist.eval.results import log_to_wandb
    from scse_dist.train.metrics_config import WandbConfig

    # The per-variant means in the single-run report's shape: one row per (variant, task).
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for (variant, task, metric), by_depth in report.table.items():
        for d, iv in by_depth.items():
            rows.setdefault((variant, task), {}).setdefault(d, {"depth": d})[metric] = iv.mean
    results = [{"_label": variant, "task": task, "results": list(by_depth.values())}
               for (variant, task), by_depth in rows.items()]
    log_to_wandb(results, WandbConfig(mode=mode), name=f"{report.study.name}-report",
                 group=report.study.name, out_dir=out, images=images)


def _write_report_files(report: StudyReport, out: Path) -> dict[str, str]:
    """report.md, aggregate.json and the PNGs into `out`; returns {title: PNG path}."""
    images = {}
    if report.table:
        images["frontier vs loop depth"] = frontier_plot(report.frontier_series("depth"),
                                                         out / "frontier_depth.png", "loop depth T")
        images["frontier vs FLOPs"] = frontier_plot(report.frontier_series("flops"),
                                                    out / "frontier_flops.png",
                                                    "training FLOPs per token (unrolled depth)",
                                                    log_base=10)
    diag = report.diagnose_series()
    if diag:
        images["loop diagnostics"] = diagnose_plot(diag, out / "diagnose.png")
    during = report.training_diagnostics_series()
    if during:
        images["loop diagnostics during training (dashed: flagged loop inactive)"] = \
            training_diagnostics_plot(during, report.collapsed(), out / "training_diagnostics.png")
    (out / REPORT_NAME).write_text(report.markdown(images), encoding="utf-8")
    (out / "aggregate.json").write_text(json.dumps(report.numbers(), indent=2) + "\n",
                                        encoding="utf-8")
    return images


def write_study_report(study_dir: str | Path, out_dir: str | Path | None = None,
                       wandb_mode: Literal["auto", "offline", "online", "disabled"] = "auto"
                       ) -> Path:
    """Write the report into out_dir (default STUDY_DIR/report) and log it to wandb ("auto":
    offline unless every run disables wandb). Returns the report.md path."""
    report = StudyReport(load_study(study_dir))
    out = Path(out_dir) if out_dir is not None else Path(study_dir) / "report"
    with output_dir(str(out), lambda u: (Path(u) / REPORT_NAME).is_file(), REPORT_NAME) as tmp:
        images = _write_report_files(report, Path(tmp))
    images = {name: str(out / Path(p).name) for name, p in images.items()}
    if wandb_mode == "auto":  # offline, unless every run config there is disables wandb
        configs = [r.config for r in report.study.runs if r.config is not None]
        wandb = not configs or any(c.wandb.enabled for c in configs)
        wandb_mode = "offline" if wandb else "disabled"
    if wandb_mode != "disabled":
        _log_to_wandb(report, out, wandb_mode, images)
    return out / REPORT_NAME
