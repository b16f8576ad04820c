"""`scse-study SPEC.yaml`: a grid of runs (variants x axes x seeds, an optional LR sweep) from one
spec, on this machine or on a batch system, then the study report.

    scse-study SPEC.yaml [key=value ...] --dry-run   # the runs, their status (and GPU-hours)
    scse-study SPEC.yaml --local                     # in sequence here, then the report
    scse-study SPEC.yaml --slurm [--max-parallel P]  # job arrays, at most P runs at once
    scse-study SPEC.yaml --backend NAME [...]        # the same on any backend (local: here)

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
from scse_dist.study.execute import run_local, run_submitted
from scse_dist.study.plan import StudyError, missing_inputs, read_choice, refused_data, status
from scse_dist.study.runs import check_runs, expand, run_config
from scse_dist.study.spec import load_spec


def runs_table(spec) -> str:
    """One line per run: variant, seed, lr ('from-sweep' until chosen), stage, run dir, status."""
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


def gpu_hours(spec) -> str | None:
    """A GPU study's training cost as `scse-train --plan` sizes it, per stage; None without GPUs.
    Once per variant and stage: seeds differ only in depth draws, the rate changes no time."""
    res = spec.resources
    if not res.gpus_per_node:
        return None
    from scse_dist.train.plan import Assumptions, build

    world, assumed = res.nodes * res.gpus_per_node, Assumptions(gpus_per_node=res.gpus_per_node)
    hours: dict[str, float] = {}
    longest, plan = 0.0, {}
    planned: dict[tuple[str, str], dict] = {}
    for run in expand(spec, read_choice(spec)):
        key = (run.variant, run.stage)
        if key not in planned:
            planned[key] = build(run_config(spec, run), world, assumed)
        plan = planned[key]
        hours[run.stage] = hours.get(run.stage, 0.0) + plan["seconds_run"] * world / 3600
        longest = max(longest, plan["seconds_run"])
    stages = ", ".join(f"{stage} {h:,.1f}" for stage, h in hours.items())
    limit = f" (resources.time_min {res.time_min / 60:g} h)" if res.time_min else ""
    return (f"planned GPU-hours: {sum(hours.values()):,.1f} ({stages}) on {world} x "
            f"{plan['gpu_name']} ({res.nodes} node(s) of {res.gpus_per_node}); the longest run "
            f"{longest / 3600:.1f} h{limit}; training only, at scse-train --plan's "
            f"{assumed.mfu:.0%} MFU of {plan['assumptions']['peak_tflops']:g} TFLOPS")


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
    an input file of some run is missing, 65 (--dry-run) a run's data would be refused (another
    tokenizer's shards, a tokenizer larger than model.vocab_size); 75 stopped by SIGINT or
    SIGTERM, the run in progress saved (rerun to resume), or a run dir's config would be rewritten
    while another process trains that run (its lock)."""
    args = build_parser().parse_intermixed_args(argv)
    if args.max_parallel < 1:
        print("scse-study: --max-parallel: must be >= 1", file=sys.stderr)
        return 2
    spec = check_runs(load_spec(args.spec, args.overrides))
    try:
        if args.dry_run:
            print(runs_table(spec))
            cost = gpu_hours(spec)
            if cost:
                print(cost)
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
