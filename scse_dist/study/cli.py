"""`scse-study SPEC.yaml`: a grid of runs (variants x axes x seeds, an optional LR sweep) from one
spec, on this machine or on a batch system, then the study report.

    scse-study SPEC.yaml [key=value ...] --dry-run   # the runs, their status (and GPU-hours)
    scse-study SPEC.yaml --local                     # in sequence here, then the report
    scse-study SPEC.yaml --slurm [--max-parallel P]  # job arrays, at most P runs at once
    scse-study SPEC.yaml --backend NAME [...]        # the same on any backend (local: here)
    scse-study SPEC.yaml --variants a,b --local      # only these variants' runs (a piece)
    scse-study SPEC.yaml --report                    # validation scores and the report, over
                                                     # every run so far; trains nothing

`key=value` overrides top-level spec fields (`out=/scratch/studies`) or the overrides every run
gets (`overrides.data.path=...`). See docs/studies.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

from scse_dist.cli_errors import EXIT_NO_INPUT, cli_main, command_parser
from scse_dist.launch.backends import BACKENDS, get_backend
from scse_dist.launch.children import StoppedBySignal
from scse_dist.launch.scheduler import add_backend_args, backend_args
from scse_dist.study.costing import gpu_hours
from scse_dist.study.execute import run_local, run_report, run_submitted
from scse_dist.study.plan import (
    RUNS_NAME,
    StudyError,
    missing_inputs,
    read_choice,
    refused_data,
    selected,
    status,
)
from scse_dist.study.runs import check_runs, expand, run_config
from scse_dist.study.spec import load_spec


def runs_table(spec) -> str:
    """One line per run: variant, seed, lr ('from-sweep' until chosen), stage, run dir, status."""
    chosen = read_choice(spec)
    rows = [("variant", "seed", "lr", "stage", "run_dir", "status")]
    for run in selected(spec, expand(spec, chosen)):
        lr = run.lr if run.lr is not None else (
            None if spec.lr else run_config(spec, run).train.optimizer.lr)
        shown = f"{lr:g}" if lr is not None else "from-sweep"
        rows.append((run.variant, str(run.seed), shown, run.stage, run.run_dir,
                     status(spec, run)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def stages(spec) -> list[str]:
    """The study's stages in order, with the runs and seeds of each (the selected variants)."""
    runs = selected(spec, expand(spec, read_choice(spec)))
    sweep = [r for r in runs if r.stage == "sweep"]
    final = len(runs) - len(sweep)
    steps = []
    if sweep:
        steps += [f"sweep ({len(sweep)} runs at seed {sweep[0].seed})",
                  "rates chosen on " + ("validation.path" if spec.validation else "lr.validation")]
    steps.append(f"final ({final} runs at seeds {', '.join(map(str, spec.seeds))})")
    if spec.validation:
        steps.append(f"validation ({spec.validation.path}, each final run)")
    steps.append("report" + (" (the pre-registration first)" if spec.preregistration else ""))
    return ["stages: " + " -> ".join(steps)]


def edge_rule(spec) -> list[str]:
    """The sweep's edge rule, when the spec asks for it (lr.extend_edges)."""
    if not spec.lr or not spec.lr.extend_edges:
        return []
    return ["edge rule (lr.extend_edges): a variant whose best sweep rate is the lowest or highest "
            "of its grid stops the study before its final runs, naming the rate one step past "
            "that edge; add it to the variant's grid and rerun, until every choice is interior"]


def evaluation_files(spec) -> list[str]:
    """Each file the study evaluates on, by field: the choices' and the test sets'."""
    files = {}
    if spec.validation:
        files["validation (chooses)"] = spec.validation.path
    elif spec.lr:
        files["lr.validation (chooses)"] = spec.lr.validation
    for task, path in [("wikitext", spec.evals.wikitext), ("lambada", spec.evals.lambada),
                       *spec.evals.data.items()]:
        if path and task in spec.evals.tasks and task != "validation":
            files[f"{task} (test)"] = path
    if "heldout" in spec.evals.tasks:
        files["heldout (test)"] = "data.path's held-out split"
    return [f"evaluation file: {name}: {path}" for name, path in files.items()]


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("scse-study", __doc__)
    p.add_argument("spec", help="study spec YAML (configs/studies/*.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value spec overrides")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--dry-run", action="store_true", help="print the runs and their status")
    how.add_argument("--local", action="store_true", help="run everything here, in sequence")
    how.add_argument("--slurm", action="store_const", const="slurm", dest="backend",
                     help="submit Slurm job arrays (= --backend slurm)")
    how.add_argument("--backend", choices=sorted(BACKENDS),
                     help="submit job arrays to this batch system (scse_dist.launch.backends)")
    how.add_argument("--report", action="store_true",
                     help="score the finished runs on the spec's validation text and write the "
                          "report over every run of the study so far; trains and submits nothing")
    p.add_argument("--variants", default="", metavar="A,B",
                   help="run only these variants (a study run in pieces: runs.json keeps them "
                        "all, and the report covers every piece)")
    p.add_argument("--max-parallel", type=int, default=4, metavar="P",
                   help="--slurm/--backend: at most P of the study's jobs at once: the arrays' "
                        "%%P; each run is evaluated inside its training job, and the stage jobs "
                        "run between arrays")
    add_backend_args(p, "the training arrays (--slurm/--backend), after the spec's resources: "
                        "(e.g. '--time=2-0 --account=me' for Slurm)")
    p.add_argument("--stage", choices=["auto", "sweep", "final", "report"], default="auto",
                   help=argparse.SUPPRESS)  # the jobs that continue a study call this
    return p


@cli_main("scse-study")
def main(argv: Sequence[str] | None = None) -> int:
    """0 done (or submitted); 1 a run or the report failed; 2 bad spec or arguments; 66 (--dry-run)
    an input file of some run is missing, 65 (--dry-run) a run's data would be refused (another
    tokenizer's shards, a tokenizer larger than model.vocab_size); 75 stopped by SIGINT or
    SIGTERM, the run in progress saved (rerun to resume), or a run dir's config would be rewritten
    while another process trains that run (its lock)."""
    args = build_parser().parse_intermixed_args(argv)
    if args.max_parallel < 1:
        print("scse-study: --max-parallel: must be >= 1", file=sys.stderr)
        return 2
    spec = check_runs(load_spec(args.spec, args.overrides))
    only = [v for v in args.variants.split(",") if v]
    stray = [v for v in only if v not in spec.variants]
    if stray:
        print(f"scse-study: --variants: {stray[0]!r} is not a variant of the spec (known: "
              f"{', '.join(spec.variants)})", file=sys.stderr)
        return 2
    spec.only = only
    try:
        if args.report:
            if not (spec.study_dir / RUNS_NAME).is_file():
                print(f"scse-study: --report: {spec.study_dir / RUNS_NAME}: no such file (nothing "
                      "of this study has run yet)", file=sys.stderr)
                return EXIT_NO_INPUT
            return 1 if run_report(spec) else 0
        if args.dry_run:
            print(runs_table(spec))
            cost = gpu_hours(spec, read_choice(spec))
            for line in stages(spec) + cost + edge_rule(spec) + evaluation_files(spec):
                print(line)
            missing = missing_inputs(spec)
            # nothing missing: what the runs' own data checks would refuse, with their status
            refused = [] if missing else refused_data(spec)
            for line in missing + [line for _, line in refused]:
                print(f"scse-study: {line}", file=sys.stderr)
            return EXIT_NO_INPUT if missing else refused[0][0] if refused else 0
        if args.local:
            return run_local(spec)
        flags = backend_args(args, "scse-study")
        cli_args = [str(Path(args.spec).resolve()), *args.overrides, f"--backend={args.backend}",
                    f"--max-parallel={args.max_parallel}", f"--backend-args={flags}",
                    f"--variants={args.variants}"]
        return run_submitted(spec, args.stage, args.max_parallel, get_backend(args.backend),
                             shlex.split(flags), cli_args)
    except StudyError as exc:
        print(f"scse-study: {exc}", file=sys.stderr)
        return 1
    except StoppedBySignal as exc:
        print(f"scse-study: {exc}", file=sys.stderr, flush=True)
        return exc.status


if __name__ == "__main__":
    raise SystemExit(main())
