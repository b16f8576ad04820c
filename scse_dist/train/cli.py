"""`scse-train` / `launch/train.py`: parse `--config PATH key.sub=value ...`, check, build the data
(data.build: the data step), then train.

Works under deepspeed (which appends --local_rank=N), torchrun, srun and plain python. Exit
statuses: EXIT_STATUSES (--help); errors are one line on stderr from every rank that meets them.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Sequence

from scse_dist.cli_errors import cli_main
from scse_dist.config import RunConfig, config_yaml, load_config

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
EXIT_STATUSES = """exit statuses:
  0    finished: checkpoint, export (and evaluation) written (--dry-run, --plan: the run
       would start; otherwise they exit with the status below that the run would have)
  1    a crash (an exception; "rank R crashed after step N" says where): a Slurm training job
       requeues itself up to launch.max_retries times
  2    bad arguments or config, before anything starts (one line naming the field)
  3    too many non-finite steps in a row (the nonfinite callback's max_in_a_row); the last
       good checkpoint is kept
  4    too many loss spikes in a row (the spike_skip callback's max_in_a_row); the last good
       checkpoint is kept
  65   bad input data (another tokenizer's shards, a tokenizer larger than model.vocab_size,
       corrupt data past data.max_failures, a split with nothing readable)
  66   an input is missing or unreadable (every file the config names: data.path,
       data.tokenizer, train.engine.deepspeed_config, eval files, init_from, branch_from)
  74   no space left writing a checkpoint, the export, a metrics row (a full disk, a quota or
       a file-size limit): the line names the path and the free space; the last checkpoint
       is intact: free space and rerun the same command to resume
  75   preempted by SIGTERM, SIGUSR1 or Ctrl-C: the step in flight was saved; rerun to resume;
       or another process holds the run dir's lock (one line names it): rerun when it has ended
  130  a second Ctrl-C: stopped at once without saving"""


def _epilog() -> str:
    shipped = sorted(p.name for p in CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []
    configs = ("shipped configs (configs/): " + ", ".join(shipped)) if shipped else \
        "shipped configs: configs/*.yaml in the repository"
    return (f"{EXIT_STATUSES}\n\nconfig fields: docs/config.md (every field, its default and "
            f"meaning); training: docs/training.md\n{configs}")


# --plan's own flags: (flag, type, default shown in --help, help); None in args: the default
PLAN_FLAGS = [
    ("--world-size", int, "required with --plan; --dry-run: the launcher's",
     "GPUs the run trains on"),
    ("--gpu", str, "h100", "h100, h200 or a100"),
    ("--mfu", float, "0.40", "model FLOPs utilisation the time assumes, a fraction"),
    ("--tokens", float, "train.max_steps steps", "tokens the run trains on, e.g. 10e9"),
    ("--gpus-per-node", int, "8", "GPUs per node"),
    ("--link-gbs", float, "the GPU's NVLink on one node, its NIC across nodes",
     "GB/s each GPU sends in collectives"),
    ("--memory-fraction", float, "0.90", "of each GPU's memory the plan may fill"),
]


def _plan_assumptions(args: argparse.Namespace):
    """(--world-size, --plan's flags as Assumptions); a plan flag without --plan is a one-line
    error (--world-size also goes with --dry-run)."""
    from scse_dist.typed_yaml import ConfigError

    given = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
             for flag, *_ in PLAN_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    world_size = given.pop("world_size", None)  # --dry-run's, instead of the launcher's
    if not args.plan:
        if world_size is not None and not args.dry_run:
            raise ConfigError("--world-size: only with --plan or --dry-run")
        named = [f"--{k.replace('_', '-')}" for k in given] + (["--json"] if args.json else [])
        if named:
            raise ConfigError(f"{named[0]}: only with --plan")
        return world_size, None
    if world_size is None:
        raise ConfigError("--plan: needs --world-size (the GPUs the run trains on)")
    from scse_dist.train.plan import Assumptions

    return world_size, Assumptions(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scse-train", description=__doc__.split("\n\n")[0],
                                     epilog=_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="run config YAML (defaults when omitted)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the parameter count, the global batch's derivation "
                             "(micro x accumulation x world; --world-size W for another world "
                             "than the launcher's), FLOPs per token at the run's depths, the "
                             "tokens it will see and a memory estimate without creating "
                             "anything, then the run's own checks: exit 0 only if it would start, "
                             "else the status the run would have")
    plan = parser.add_argument_group(
        "planning a cluster run (--plan; docs/launching.md, 'Sizing a run')")
    plan.add_argument("--plan", action="store_true",
                      help="print memory per GPU (training state, activations with and without "
                           "loop checkpointing, the largest micro-batch that fits), communication "
                           "and time per step and for the run, then the run's own checks: exit 0 "
                           "only if it would start; needs --world-size")
    for flag, kind, default, text in PLAN_FLAGS:
        plan.add_argument(flag, type=kind, default=None, help=f"{text} (default {default})")
    plan.add_argument("--json", action="store_true", help="the plan as JSON, for machines")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (YAML, overrides applied) and exit 0")
    # The deepspeed launcher passes --local_rank; LOCAL_RANK in the environment is what we use.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. train.max_steps=100 model.depth=8")
    return parser


def check_can_start(cfg: RunConfig, args: argparse.Namespace, build: bool = False) -> bool:
    """The checks a run makes before it starts, each one line and exit 2, 65 or 66 (--dry-run and
    --plan end with them: they exit with the status the run would have); with `build`, the
    launcher's world too, then the data step. Returns whether data.build writes the data."""
    from scse_dist.data.preflight import check_then_build
    from scse_dist.train.callbacks.assembly import check_callbacks
    from scse_dist.train.tensorboard import check_tensorboard

    check_tensorboard(cfg.tensorboard)  # tensorboard.enabled without the package: one line, exit 2
    # the data's checks first, before torch is imported (check_callbacks imports their modules)
    return check_then_build(cfg, args.config, args.overrides, lambda: check_callbacks(cfg), build)


@cli_main("scse-train")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # flags anywhere among the overrides
    # a ConfigError is exit 2, before any process group
    cfg = load_config(args.config, args.overrides)
    world_size, assumptions = _plan_assumptions(args)
    if args.plan:
        import json

        from scse_dist.train.plan import build, render

        plan = build(cfg, world_size, assumptions)
        print(json.dumps(plan, indent=2) if args.json else render(plan), flush=True)
        check_can_start(cfg, args)  # then the status the run would have
        return 0
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    if args.dry_run:  # the report, then what the run's checks say, and their status
        from scse_dist.train.dry_run import describe

        print(describe(cfg, world_size), flush=True)
        building = check_can_start(cfg, args)
        print(f"data: {cfg.data.path} (" + (f"not built yet; data.build={cfg.data.build} builds "
                                            "it at the start" if building else
                                            "present and readable") + ")")
        return 0
    check_can_start(cfg, args, build=True)  # then the trainer, which only reads shards
    from scse_dist.train.faults import PREEMPT_SIGNALS, REQUEUE_EXIT_CODE, TrainingStopped
    from scse_dist.train.loop import train  # imports deepspeed only once the config is good

    try:
        summary = train(cfg)
    except TrainingStopped as exc:
        print(f"scse-train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    if summary["preempted"]:
        # srun --kill-on-bad-exit SIGTERMs the other tasks at the first 75: a rank killed while
        # it exits would make srun return 143 and the job would not be requeued. SIG_IGN, not a
        # Python handler, which the interpreter resets while it exits.
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return REQUEUE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
