"""`scse-export`: the trainer's export (same files) from a DeepSpeed checkpoint.

    scse-export RUN_DIR_OR_TAG --out DIR [--tokenizer PATH_OR_URL]

RUN_DIR_OR_TAG is a run dir, its checkpoints/ dir (the tag `latest` names) or one step-N tag dir.
DIR gets model.safetensors (the fp32 weights, consolidated on CPU from any ZeRO stage),
config.yaml (the tag's config), the tokenizer (tokenizer.model, tokenizer.json or tokenizer.tiktoken
by its kind: a copy of the config's data.tokenizer, a path relative to where the run was launched,
or --tokenizer) and the Hugging Face files (scse_dist/hf).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import ContextManager, Sequence

from scse_dist.cli_errors import InputError, cli_main, command_parser, from_config
from scse_dist.quiet import add_verbose_flag, set_verbose


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("scse-export", __doc__)
    p.add_argument("checkpoint", metavar="RUN_DIR_OR_TAG",
                   help="run dir, its checkpoints/ dir, or one checkpoints/step-N tag dir")
    p.add_argument("--out", required=True, help="export dir to write")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file to copy in (.model, tokenizer.json, .tiktoken); default: "
                        "the config's data.tokenizer")
    add_verbose_flag(p)
    return p


def _run_dir_lock(out: str) -> ContextManager[object]:
    """The lock of the run dir `out` lies in (`out` or the nearest folder above it holding
    checkpoints/ and config.yaml): an export into a run dir is one of its writers. Elsewhere,
    nothing to hold."""
    from scse_dist.run_dir import RunDir
    from scse_dist.run_lock import held

    if "://" not in out:
        path = Path(out).resolve()
        for folder in map(RunDir, (path, *path.parents)):
            if folder.checkpoints.is_dir() and folder.config.is_file():
                return held(folder.path)
    return contextlib.nullcontext()


@cli_main("scse-export")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad arguments or config; 65 a tokenizer that is not one, or weights
    that do not fit the config; 66 a checkpoint, config or tokenizer that is missing or
    unreadable; 75 --out is in a run dir another process is writing (its lock). Errors are one
    line on stderr naming the file."""
    args = build_parser().parse_args(argv)
    set_verbose(args.verbose)
    with _run_dir_lock(args.out):  # before anything is read or written: a busy run dir is exit 75
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    from scse_dist.checkpoint.export import describe_mismatch, save_exported_model, weights_mismatch
    from scse_dist.checkpoint.loading import checkpoint_weights, deepspeed_checkpoint
    from scse_dist.config import load_saved_config
    from scse_dist.data.tokenizer import Tokenizer

    root, tag, config = deepspeed_checkpoint(args.checkpoint)
    cfg = load_saved_config(config)
    # a missing tokenizer fails before the (slow) consolidation; --tokenizer tells its own kind
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer, "auto")
    else:
        with from_config("data.tokenizer", cfg.data.tokenizer, str(config), "--tokenizer"):
            tokenizer = Tokenizer.load(cfg.data.tokenizer, cfg.data.tokenizer_kind)
    import torch  # after the inputs are checked: a bad path is reported in a fraction of a second

    from scse_dist.model import LoopedLM

    state = checkpoint_weights(root, tag)
    with torch.device("meta"):  # shapes only: no memory for a second copy of the weights
        expected = LoopedLM(cfg.model).state_dict()
    problems = weights_mismatch(expected, state)
    if problems:
        raise InputError(f"checkpoint {str(root / tag)!r} does not match {str(config)!r}; "
                         f"{describe_mismatch(problems)}")
    out = save_exported_model(state, cfg, args.out, tokenizer=tokenizer)
    print(f"scse-export: {root / tag} -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
