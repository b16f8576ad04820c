"""`scse-convert`: a Hugging Face checkpoint in, as an export of an untied model; an untied export
out, as a plain Hugging Face folder (docs/pretrained.md).

    scse-convert from-hf DIR_OR_HUB_ID --out EXPORT
    scse-convert to-hf EXPORT --out DIR
    scse-convert retrofit EXPORT --out EXPORT2 --recurrence scse --prelude 0-3 --core 10-17 \
        --coda 18-21

from-hf reads a save_pretrained folder of LlamaForCausalLM or Qwen3ForCausalLM (config.json,
safetensors weights, tokenizer.json), or downloads a hub id where the network allows. to-hf writes
LlamaForCausalLM (Qwen3ForCausalLM under model.qk_norm), which transformers loads without
trust_remote_code. retrofit builds a looped model from an untied export by a layer map
(docs/retrofit.md).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from scse_dist.cli_errors import cli_main, command_parser
from scse_dist.convert.retrofit import add_retrofit_parser, run_retrofit
from scse_dist.quiet import add_verbose_flag, set_verbose


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("scse-convert", __doc__)
    sub = p.add_subparsers(dest="command", required=True)
    src = sub.add_parser("from-hf", help="a Hugging Face Llama/Qwen3 checkpoint -> an export")
    src.add_argument("source", metavar="DIR_OR_HUB_ID",
                     help="a save_pretrained folder, or a hub id (owner/name)")
    src.add_argument("--out", required=True, help="export dir to write")
    dst = sub.add_parser("to-hf", help="an untied export -> a plain Hugging Face folder")
    dst.add_argument("export", metavar="EXPORT", help="export dir (scse-export, scse-convert)")
    dst.add_argument("--out", required=True, help="folder to write")
    for sp in (src, dst, add_retrofit_parser(sub)):
        add_verbose_flag(sp)
    return p


@cli_main("scse-convert")
def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad arguments (retrofit: a bad layer map); 65 a checkpoint or export
    the other side cannot compute exactly (the line names the field), or files that are not what
    they claim; 66 a folder, file or hub id that is missing or cannot be read. Nothing is written
    unless it succeeds."""
    args = build_parser().parse_args(argv)
    set_verbose(args.verbose)
    if args.command == "retrofit":
        return run_retrofit(args)
    if args.command == "from-hf":
        from scse_dist.convert.hf_import import import_hf

        out, cfg = import_hf(args.source, args.out)
        print(f"scse-convert: {args.source} -> {out} (untied, {cfg.n_core} layers, "
              f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings)", flush=True)
        return 0
    from scse_dist.convert.hf_export import export_hf

    print(export_hf(args.export, args.out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
