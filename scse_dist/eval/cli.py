"""`scse-eval`: evaluate a model at several loop depths and write a results JSON.

    scse-eval --checkpoint runs/x/export --task {heldout,wikitext,lambada,diagnose} \\
              --data PATH_OR_URL --depths 1,8,48 --out results.json [--stride 128] ...
    scse-eval ... --exit motion:0.02    adaptive depth per token: quality and steps used

--checkpoint is an export dir (a path or an fsspec URL) or a DeepSpeed checkpoint dir (run dir,
checkpoints/ or a tag). Defaults for --data, --depths, --batch-size, --max-batches, --seq-len and
--tokenizer come from the model's config (data.path, eval.*, data.seq_len, data.tokenizer; an
export's tokenizer is its own copy, e.g. tokenizer.model).
"""

from __future__ import annotations

import argparse
import dataclasses
from contextlib import nullcontext
from typing import Sequence

from scse_dist.cli_errors import cli_main, command_parser, from_config
from scse_dist.eval.inputs import TASKS, load_tokenizer, no_exit_rule, read_task_data
from scse_dist.model.exit_rules import ExitRule, parse_exit_rule
from scse_dist.quiet import add_verbose_flag, set_verbose


def _depth_list(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,8,48, got {text!r}") from None
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"depths must be integers >= 1, got {text!r}")
    return depths


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _exit_rule(text: str) -> ExitRule:
    try:
        return parse_exit_rule(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("scse-eval", __doc__)
    p.add_argument("--checkpoint", required=True,
                   help="export dir (model.safetensors, config.yaml, the tokenizer; a path or an "
                        "fsspec URL) or DeepSpeed checkpoint dir")
    p.add_argument("--task", required=True, choices=list(TASKS))
    p.add_argument("--data", default=None,
                   help="heldout/diagnose: shard dir with index.json or a JSONL/text corpus; "
                        "wikitext: wiki.*.raw; lambada: JSONL or plain text (paths or fsspec "
                        "URLs); default: config data.path")
    p.add_argument("--depths", type=_depth_list, default=None,
                   help="comma-separated loop depths, e.g. 1,8,48; default: config eval.depths")
    p.add_argument("--out", required=True, help="results JSON path")
    p.add_argument("--batch-size", type=_positive, default=None)
    p.add_argument("--max-batches", type=_non_negative, default=None, help="0: the whole split")
    p.add_argument("--seq-len", type=_positive, default=None)
    p.add_argument("--stride", type=_positive, default=None,
                   help="wikitext sliding-window stride in tokens; default seq_len // 2")
    p.add_argument("--tokenizer", default=None, help="text inputs; default: config data.tokenizer")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--exit", type=_exit_rule, default=None, metavar="RULE",
                   help="adaptive depth per token: fixed | kl:TAU | motion:TAU, optionally "
                        ",min=N,max=N (e.g. motion:0.02); reports quality with the mean and "
                        "distribution of steps used, at the cap max (default: the largest depth)")
    add_verbose_flag(p)
    return p


@cli_main("scse-eval")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad arguments; 65 bad input data (empty file, malformed JSON line,
    not UTF-8, a passage of one word, a tokenizer that is not one or too big for the model);
    66 a checkpoint, data or tokenizer that is missing or unreadable; 130 Ctrl-C, after writing
    the results of the items done (marked "partial"). Errors are one line on stderr naming the
    file (and line). Progress (items done, rate, ETA) goes to stderr."""
    parser = build_parser()
    args = parser.parse_args(argv)
    set_verbose(args.verbose)
    if args.exit is not None and not TASKS[args.task].scores_tokens:
        parser.error(f"--exit: {no_exit_rule(args.task)}")
    from scse_dist.checkpoint.export import local_export

    with local_export(args.checkpoint) as checkpoint:  # a URL: a temporary local copy
        evaluate(parser, args, checkpoint)
    return 0


def evaluate(parser: argparse.ArgumentParser, args: argparse.Namespace, checkpoint: str) -> None:
    from scse_dist.checkpoint.loading import checkpoint_config, device_flag, load_model

    cfg = checkpoint_config(checkpoint)
    seq_len = args.seq_len or cfg.data.seq_len
    if seq_len > cfg.model.max_seq_len:
        parser.error(f"--seq-len {seq_len} exceeds the model's max_seq_len={cfg.model.max_seq_len}")
    if args.stride and args.stride > seq_len:
        parser.error(f"--stride {args.stride} exceeds the sequence length {seq_len}")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, seq_len=seq_len,
                                 tokenizer=args.tokenizer or cfg.data.tokenizer),
        eval=dataclasses.replace(cfg.eval, batch_size=args.batch_size or cfg.eval.batch_size))
    max_batches = cfg.eval.max_batches if args.max_batches is None else args.max_batches
    data = args.data or cfg.data.path
    # The model's tokenizer (--tokenizer, else the export's own copy) reads text and shards. Bad
    # data fails before the weights load; one from the config with a line naming the flag.
    with nullcontext() if args.tokenizer else from_config(
            "data.tokenizer", cfg.data.tokenizer, args.checkpoint, "--tokenizer"):
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data, cfg.model)
    with nullcontext() if args.data else from_config("data.path", data, args.checkpoint, "--data"):
        task_data = read_task_data(args.task, cfg.data, cfg.model, cfg.eval.batch_size, data,
                                   tokenizer)
    import torch  # only now: bad input above is reported without it

    from scse_dist.eval.task_run import run_task
    from scse_dist.threads import configure_threads

    configure_threads()  # torch's default threads beside another busy process: 10x slower
    device = device_flag(args.device) if args.device else (
        "cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(checkpoint, device=device)
    run_task(args.task, model, cfg, data, args.depths or cfg.eval.depths, args.out,
             checkpoint_label=args.checkpoint, stride=args.stride, max_batches=max_batches,
             task_data=task_data, exit_rule=args.exit)


if __name__ == "__main__":
    raise SystemExit(main())
