"""`scse-eval`: evaluate an exported model and write a results JSON.

    scse-eval --checkpoint runs/x/export --task heldout --data data/shards \\
              --depths 1,8,48 --out results.json [--batch-size 8] [--max-batches N] [--seq-len L]

Defaults for --data, --depths, --batch-size, --max-batches and --seq-len come from the export's
config.yaml (data.path, eval.*, data.seq_len).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import torch

from scse_dist.config import RunConfig
from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.eval.results import format_table, write_results

TASKS = ("heldout",)


def run_heldout_eval(model: torch.nn.Module, cfg: RunConfig, data_path: str, depths: list[int],
                     out_path: str, checkpoint_label: str, max_batches: int = 0) -> list[dict]:
    """Held-out perplexity of `model` at `depths` on the shard dir `data_path`; prints, writes JSON.

    Sequence length and batch size come from `cfg.data.seq_len` and `cfg.eval.batch_size`. Called by
    `scse-eval` and by the trainer in-process after training (on one rank: it reads every shard).
    """
    from scse_dist.data.shards import read_index  # the data stack is only needed to evaluate
    from scse_dist.data.stream import TokenStream

    # Shards from a bigger tokenizer would index past the embedding: say so instead of crashing.
    index = read_index(str(data_path))
    if index["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(f"{data_path}: shards were written with vocab_size={index['vocab_size']}, "
                         f"more than the model's model.vocab_size={cfg.model.vocab_size}")
    if not index["splits"].get("heldout"):
        raise ValueError(f"{data_path}: index.json lists no heldout shards "
                         "(build shards with data.heldout_fraction > 0)")
    stream = TokenStream(data_path, split="heldout", seq_len=cfg.data.seq_len,
                         batch_size=cfg.eval.batch_size, rank=0, world_size=1, seed=0, loop=False)
    rows = evaluate_heldout(model, stream, depths, max_batches=max_batches)
    print(f"held-out perplexity: {checkpoint_label} ({cfg.model.recurrence}, {cfg.model.residual}) "
          f"on {data_path}, {rows[0]['tokens']} tokens")
    print(format_table(rows))
    write_results(out_path, "heldout", checkpoint_label, cfg, rows,
                  extra={"data": str(data_path), "seq_len": cfg.data.seq_len,
                         "batch_size": cfg.eval.batch_size, "max_batches": max_batches})
    print(f"wrote {out_path}")
    return rows


def _depth_list(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,8,48, got {text!r}")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scse-eval", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="exported model dir (model.safetensors + config.yaml)")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--data", default=None,
                   help="shard dir (path or fsspec URL) with index.json; default: config data.path")
    p.add_argument("--depths", type=_depth_list, default=None,
                   help="comma-separated loop depths, e.g. 1,8,48; default: config eval.depths")
    p.add_argument("--out", required=True, help="results JSON path")
    p.add_argument("--batch-size", type=_positive, default=None)
    p.add_argument("--max-batches", type=_non_negative, default=None, help="0: the whole split")
    p.add_argument("--seq-len", type=_positive, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from scse_dist.export import load_exported_model

    model, cfg = load_exported_model(args.checkpoint, device=args.device)
    seq_len = args.seq_len or cfg.data.seq_len
    if seq_len > cfg.model.max_seq_len:
        parser.error(f"--seq-len {seq_len} exceeds the model's max_seq_len={cfg.model.max_seq_len}")
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, seq_len=seq_len),
        eval=dataclasses.replace(cfg.eval, batch_size=args.batch_size or cfg.eval.batch_size))
    max_batches = cfg.eval.max_batches if args.max_batches is None else args.max_batches
    run_heldout_eval(model, cfg, args.data or cfg.data.path, args.depths or cfg.eval.depths,
                     args.out, checkpoint_label=args.checkpoint, max_batches=max_batches)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
