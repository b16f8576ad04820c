"""`scse-study SPEC.yaml`: a grid of runs (variants x axes x seeds, an optional LR sweep) from one
spec, on this machine or on a batch system, then the study report.

    scse-study SPEC.yaml [key=value ...] --dry-run        # the table of runs and their status
    scse-study SPEC.yaml --local                          # in sequence here, then the report
    scse-study SPEC.yaml --slurm [--max-parallel P]       # job arrays, at most P runs at once
    scse-study SPEC.yaml --backend NAME [...]             # the same on any backend (--slurm:
                                                          # slurm; local: this machine's jobs)

`key=value` overrides top-level spec fields (`out=/scratch/studies`) or the overrides every run
gets (`overrides.data.path=...`). See scse_dist.study.spec (format), .plan (layout), .execute.
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
from scse_dist.study.execute import run_local, run_submitted
from scse_dist.study.plan import StudyError, missing_inputs, read_choice, status
from scse_dist.study.spec import expand, load_spec, run_config


def runs_table(spec) -> str:
    """One line per run: variant, seed, lr (the rate it trains at; 'from-sweep' until the sweep
    picked it), stage, run dir, status (done/partial/new)."""
    chosen = read_choice(spec)
    rows = [("variant", "seed", "lr", "stage", "run_dir", "status")]
    for run in expand(spec, chosen):
        lr = run.lr if run.lr is not None else (
            None if spec.lr else run_config(spec, run).train.optimizer.lr)
        shown = f"{lr:g}" if lr is not None else "from-sweep"
        rows.append((run.variant, str(run.seed), shown, run.stage, run.run_dir,
                     status(spec, run)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
    an input file of some run is missing; 75 stopped by SIGINT or SIGTERM, the run in progress
    saved (rerun to resume)."""
    args = build_parser().parse_intermixed_args(argv)
    if args.max_parallel < 1:
        print("scse-study: --max-parallel: must be >= 1", file=sys.stderr)
        return 2
    spec = load_spec(args.spec, args.overrides)
    try:
        if args.dry_run:
            print(runs_table(spec))
            missing = missing_inputs(spec)
            for line in missing:
                print(f"scse-study: {line}", file=sys.stderr)
            return EXIT_NO_INPUT if missing else 0
        if args.local:
            return run_local(spec)
        flags = backend_args(args, "scse-study")
        cli_args = [str(Path(args.spec).resolve()), *args.overrides, f"--backend={args.backend}",
                    f"--max-parallel={args.max_parallel}", f"--backend-args={flags}"]
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
