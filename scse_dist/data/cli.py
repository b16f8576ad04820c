"""`scse-data`: train a tokenizer, write token shards, inspect them, build the quickstart corpus.

    scse-data tokenizer --input 'data/*.jsonl.gz' --vocab-size 32000 --out tok.model
    scse-data tokenizer --kind byte-bpe --input 'data/*.jsonl.gz' --vocab-size 32000 --out tok.json
    scse-data shards --input 'data/*.jsonl.gz' --tokenizer tok.model --out s3://bucket/shards
    scse-data shards --input 'data/*.parquet' --tokenizer tok.model --out shards --processes 8
    scse-data shards --input hf:wikitext:wikitext-103-raw-v1:train --tokenizer tok.model --out s
    scse-data shards ... --part K/N   then   scse-data merge OUT   (a Slurm array: docs/data.md)
    scse-data import --format llm-c-bin 'fineweb/*.bin' --tokenizer gpt2/tokenizer.json --out s
    scse-data inspect s3://bucket/shards
    scse-data quickstart --out data/quickstart
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Iterable, Iterator

from scse_dist.cli_errors import cli_main
from scse_dist.data.rows import RowStats
from scse_dist.data.sources import TEXT_SPLITS
from scse_dist.typed_yaml import ConfigError

# The readers and writers (numpy, sentencepiece, fsspec) are imported by the subcommand that
# uses them, so `--help` and a bad argument answer at once.


class _Counter:
    """Counts the documents flowing through an iterator (for the summary line)."""

    def __init__(self, docs: Iterable[str]):
        self.docs, self.n = docs, 0

    def __iter__(self) -> Iterator[str]:
        for d in self.docs:
            self.n += 1
            yield d


def _rate(n: float, seconds: float) -> str:
    return f"{n / max(seconds, 1e-9):,.0f}"


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from scse_dist.data.sources import iter_documents
    from scse_dist.data.tokenizer import Tokenizer, train_tokenizer

    start = time.time()
    if args.kind == "byte-bpe":
        given = [o for o, v in (("--model-type", args.model_type),
                                ("--no-byte-fallback", args.no_byte_fallback)) if v]
        if given:
            raise ConfigError(f"{given[0]}: a sentencepiece option; --kind byte-bpe is byte-level "
                              "(no unknown characters) and BPE")
    rows = RowStats(max_bad_rows=args.max_bad_rows)
    docs = _Counter(iter_documents(args.input, text_field=args.text_field,
                                   text_split=args.text_split, stats=rows))
    if args.kind == "byte-bpe":
        from scse_dist.data.tokenizer_hf import train_byte_bpe

        train_byte_bpe(docs, args.vocab_size, args.out, max_sentences=args.max_sentences,
                       special_tokens=args.special_tokens, sample_fraction=args.sample_fraction)
    else:
        train_tokenizer(docs, args.vocab_size, args.out, model_type=args.model_type or "bpe",
                        max_sentences=args.max_sentences,
                        byte_fallback=not args.no_byte_fallback,
                        special_tokens=args.special_tokens, sample_fraction=args.sample_fraction)
    tok = Tokenizer.load(args.out)
    dt = time.time() - start
    print(f"tokenizer {args.out}: vocab {tok.vocab_size}, sha256 {tok.sha256[:16]}, "
          f"{docs.n:,} documents read ({_rate(docs.n, dt)} docs/s), {dt:.1f}s{rows.summary()}")


def _summary(what: str, index_splits: dict, dt: float, rows: str = "") -> str:
    tokens = sum(e["tokens"] for es in index_splits.values() for e in es)
    written = sum(e["documents"] for es in index_splits.values() for e in es)
    shards = sum(len(es) for es in index_splits.values())
    return (f"{what}: {written:,} documents, {tokens:,} tokens in {shards} shards, "
            f"{dt:.1f}s ({_rate(written, dt)} docs/s, {_rate(tokens, dt)} tokens/s){rows}")


def _argv_of(parser: argparse.ArgumentParser, args: argparse.Namespace,
             skip: tuple[str, ...]) -> list[str]:
    """The command line that parses back to `args` (less the options in `skip`)."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip + ("help",):
            continue
        value = getattr(args, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif value is not None:
            argv += [action.option_strings[0],
                     *([str(v) for v in value] if isinstance(value, list) else [str(value)])]
    return argv


def cmd_shards(args: argparse.Namespace) -> int:
    from scse_dist.data.sources import iter_documents
    from scse_dist.data.tokenizer import Tokenizer

    start = time.time()
    if args.processes > 1 and args.part is not None:
        raise ConfigError("--processes and --part: give one (--processes N runs parts 0..N-1)")
    if args.processes > 1:
        from scse_dist.data.parts import PartFailed, run_and_merge
        from scse_dist.data.sources import expand_inputs

        expand_inputs(args.input)  # a missing input or tokenizer: one line, not one per part
        Tokenizer.load(args.tokenizer, args.tokenizer_kind)
        try:
            index = run_and_merge(lambda out: ["shards", *_argv_of(args.parser, argparse.Namespace(
                **{**vars(args), "out": out}), ("processes", "part"))], args.out, args.processes)
        except PartFailed as failed:
            print(f"scse-data: error: part {failed.part}/{args.processes} exited {failed.status}; "
                  "the other parts were stopped", file=sys.stderr)
            return failed.status
        print(_summary(f"shards {args.out} ({args.processes} processes)", index["splits"],
                       time.time() - start))
        return 0
    tok = Tokenizer.load(args.tokenizer, args.tokenizer_kind)
    rows = RowStats(max_bad_rows=args.max_bad_rows)
    docs = _Counter(iter_documents(args.input, text_field=args.text_field,
                                   text_split=args.text_split, stats=rows, part=args.part))
    layout = dict(heldout_fraction=args.heldout_fraction, shard_bytes=int(args.shard_mb * 2**20),
                  sample_tokens=args.sample_tokens, sources=list(args.input),
                  progress_every=args.progress_every, workers=args.workers)
    if args.part is not None:
        from scse_dist.data.parts import write_part

        record = write_part(docs, tok, args.out, args.part, **layout)
        n = sum(s["documents"] for s in record["splits"].values())
        tokens = sum(s["tokens"] for s in record["splits"].values())
        dt = time.time() - start
        print(f"shards {args.out} part {args.part[0]}/{args.part[1]}: {n:,} documents, "
              f"{tokens:,} tokens, {dt:.1f}s ({_rate(n, dt)} docs/s, {_rate(tokens, dt)} "
              f"tokens/s){rows.summary()}; merged by `scse-data merge {args.out}` once every "
              "part is done")
        return 0
    from scse_dist.data.shards import write_shards

    index = write_shards(docs, tok, args.out, **layout)
    print(_summary(f"shards {args.out}", index["splits"], time.time() - start, rows.summary()))
    return 0


def cmd_merge(args: argparse.Namespace) -> None:
    from scse_dist.data.parts import merge_parts

    start = time.time()
    index = merge_parts(args.path)
    print(_summary(f"merged {args.path}", index["splits"], time.time() - start))


def cmd_import(args: argparse.Namespace) -> None:
    from scse_dist.data.pretokenized import import_tokens, read_token_files
    from scse_dist.data.tokenizer import Tokenizer

    start = time.time()
    tok = Tokenizer.load(args.tokenizer, args.tokenizer_kind)
    files = read_token_files(args.files, args.format, tok)  # all checked before writing
    index = import_tokens(files, tok, args.out, heldout_fraction=args.heldout_fraction,
                          shard_bytes=int(args.shard_mb * 2**20), sample_tokens=args.sample_tokens)
    print(_summary(f"imported {len(files)} files into {args.out}", index["splits"],
                   time.time() - start))


def _part(text: str) -> tuple[int, int]:
    """'K/N' (K from 0 to N-1) -> (K, N)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K/N (K from 0 to N-1), got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"K must lie in 0..N-1, got {text!r}")
    return k, n


def inspect_shards(path: str) -> bool:
    """Print per-split counts and re-read every shard; return True when all match the index."""
    from scse_dist.data.index import iter_samples, read_index, shard_url, table_url
    from scse_dist.data.sample_format import load_sample_table

    index = read_index(path)
    print(f"{path}: {index['format']}, vocab {index['vocab_size']}, {index['dtype']}, "
          f"eos {index['eos_id']}, tokenizer sha256 {index['tokenizer_sha256'][:16]}")
    ok, start, read_tokens, read_docs = True, time.time(), 0, 0
    for split, entries in index["splits"].items():
        print(f"  {split}: {len(entries)} shards, "
              f"{sum(e['documents'] for e in entries):,} documents, "
              f"{sum(e['tokens'] for e in entries):,} tokens")
        for entry in entries:
            tokens = docs = samples = 0
            try:
                table = load_sample_table(table_url(path, entry), entry["samples"])
                for _, _, lens in iter_samples(shard_url(path, entry), index["eos_id"],
                                               index["vocab_size"]):
                    size = [int(lens.sum()), len(lens)]
                    if samples >= len(table) or table[samples, :2].tolist() != size:
                        said = table[samples, :2].tolist() if samples < len(table) else "nothing"
                        raise ValueError(f"sample {samples}: {size} tokens/documents, the sample "
                                         f"table says {said}")
                    tokens, docs, samples = tokens + size[0], docs + size[1], samples + 1
            except Exception as exc:  # report every bad shard, not just the first
                print(f"    BAD {entry['url']}: {exc}")
                ok = False
                continue
            want = (entry["tokens"], entry["documents"], entry.get("samples", samples))
            if (tokens, docs, samples) != want:
                print(f"    BAD {entry['url']}: read tokens/documents/samples "
                      f"{(tokens, docs, samples)}, index says {want}")
                ok = False
            read_tokens, read_docs = read_tokens + tokens, read_docs + docs
    dt = time.time() - start
    print(f"{'OK' if ok else 'FAILED'}: read {read_docs:,} documents, {read_tokens:,} tokens in "
          f"{dt:.1f}s ({_rate(read_docs, dt)} docs/s, {_rate(read_tokens, dt)} tokens/s)")
    return ok


def cmd_quickstart(args: argparse.Namespace) -> None:
    from scse_dist.data.quickstart import build_stdlib_corpus

    out = args.out.rstrip("/")
    build_stdlib_corpus(f"{out}/shards", f"{out}/tokenizer.model", args.vocab_size,
                        args.heldout_fraction)


def cmd_fetch_eval(args: argparse.Namespace) -> None:
    from scse_dist.data.eval_files import fetch_eval

    for line in fetch_eval(args.manifest, args.out, args.source, args.accept_unrecorded):
        print(line)


INPUT_HELP = ("files, globs or directories (fsspec URLs): text, JSONL, parquet, a datasets "
              "save_to_disk directory, or hf:NAME[:CONFIG]:SPLIT (the Hub, streamed)")
BAD_ROWS_HELP = ("rows without the text field or with a non-string value skipped (and counted) "
                 "before the command stops; empty rows are always skipped")
SPLIT_HELP = ("documents of a plain-text input: runs of lines between blank lines, whole files, "
              "or WikiText articles (' = Title = ' headings); JSONL is one document per line")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scse-data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tokenizer", help="train a sentencepiece or byte-level BPE tokenizer")
    t.add_argument("--kind", default="sentencepiece", choices=["sentencepiece", "byte-bpe"],
                   help="sentencepiece: a .model; byte-bpe: a GPT-2-style byte-level BPE "
                        "tokenizer.json (Hugging Face tokenizers)")
    t.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="output path or URL (.model, or .json for "
                   "byte-bpe)")
    t.add_argument("--text-field", default="text",
                   help="JSONL field or parquet/datasets column holding the text")
    t.add_argument("--max-bad-rows", type=int, default=0, help=BAD_ROWS_HELP)
    t.add_argument("--text-split", default="blank_lines", choices=TEXT_SPLITS, help=SPLIT_HELP)
    t.add_argument("--model-type", default=None, choices=["bpe", "unigram"],
                   help="sentencepiece's model (default bpe)")
    t.add_argument("--max-sentences", type=int, default=2_000_000, help="lines used for training")
    t.add_argument("--sample-fraction", type=float, default=1.0,
                   help="train on this share of the documents (hash-sampled while streaming)")
    t.add_argument("--special-tokens", nargs="*", default=[],
                   help="pieces never split, e.g. '<|im_start|>'")
    t.add_argument("--no-byte-fallback", action="store_true",
                   help="unknown characters become <unk>")
    t.set_defaults(func=cmd_tokenizer)

    s = sub.add_parser("shards", help="tokenize documents into WebDataset token shards")
    s.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    s.add_argument("--tokenizer", required=True,
                   help="a sentencepiece .model, a tokenizer.json or a tiktoken ranks file")
    s.add_argument("--tokenizer-kind", default="auto",
                   choices=["auto", "sentencepiece", "hf", "tiktoken"],
                   help="the --tokenizer's kind (auto: told by its content)")
    s.add_argument("--out", required=True, help="output directory or URL prefix")
    s.add_argument("--heldout-fraction", type=float, default=0.0)
    s.add_argument("--text-field", default="text",
                   help="JSONL field or parquet/datasets column holding the text")
    s.add_argument("--max-bad-rows", type=int, default=0, help=BAD_ROWS_HELP)
    s.add_argument("--text-split", default="blank_lines", choices=TEXT_SPLITS, help=SPLIT_HELP)
    s.add_argument("--shard-mb", type=float, default=256.0, help="shard size in MiB")
    s.add_argument("--sample-tokens", type=int, default=65536, help="tokens per tar sample")
    s.add_argument("--workers", type=int, default=0,
                   help="tokenizer processes (0: in this process)")
    s.add_argument("--progress-every", type=float, default=10.0,
                   help="seconds between progress lines when stderr is not a terminal (a bar when "
                        "it is); 0 for none")
    s.add_argument("--part", type=_part, default=None, metavar="K/N",
                   help="tokenize only part K of N (from 0) into OUT/parts; `scse-data merge OUT` "
                        "after all N (e.g. a Slurm array) writes the shards one run would")
    s.add_argument("--processes", type=int, default=1,
                   help="run the N parts as N processes here, then merge (the same bytes as one)")
    s.set_defaults(func=cmd_shards, parser=s)

    im = sub.add_parser("import", help="pre-tokenized ids (llm.c .bin, .npy, raw) into shards")
    im.add_argument("files", nargs="+", help="local files or globs (each sorted): one stream of "
                    "ids in the order written (a document cut at a file's end goes on in the next)")
    im.add_argument("--format", required=True,
                    choices=["llm-c-bin", "npy", "raw-uint16", "raw-uint32"],
                    help="llm-c-bin: llm.c's 256-int32 header, then the ids; npy: a 1-D integer "
                         "array; raw-uint16/32: little-endian ids, no header")
    im.add_argument("--tokenizer", required=True, help="the tokenizer the ids are of: its eos "
                    "separates documents, its vocabulary bounds the ids (as for shards)")
    im.add_argument("--tokenizer-kind", default="auto",
                    choices=["auto", "sentencepiece", "hf", "tiktoken"])
    im.add_argument("--out", required=True, help="output directory or URL prefix")
    im.add_argument("--heldout-fraction", type=float, default=0.0,
                    help="held out by the hash of each document's decoded text, as `shards` does "
                         "(> 0 decodes every document)")
    im.add_argument("--shard-mb", type=float, default=256.0, help="shard size in MiB")
    im.add_argument("--sample-tokens", type=int, default=65536, help="tokens per tar sample")
    im.set_defaults(func=cmd_import)

    m = sub.add_parser("merge", help="pack the parts of `shards --part K/N` into shards + index")
    m.add_argument("path", help="the --out of the parts")
    m.set_defaults(func=cmd_merge)

    i = sub.add_parser("inspect", help="print counts and check that every shard reads (exit 1 "
                                       "if one does not)")
    i.add_argument("path", help="shard directory or URL prefix")
    i.set_defaults(func=lambda a: 0 if inspect_shards(a.path) else 1)

    q = sub.add_parser("quickstart", help="build the stdlib-docstring corpus (no download)")
    q.add_argument("--out", default="data/quickstart",
                   help="writes OUT/tokenizer.model, OUT/shards")
    q.add_argument("--vocab-size", type=int, default=4096)
    q.add_argument("--heldout-fraction", type=float, default=0.02)
    q.set_defaults(func=cmd_quickstart)

    f = sub.add_parser("fetch-eval", help="fetch, checksum and prepare a study's evaluation files "
                       "(WikiText-103, LAMBADA) from the Hub at pinned revisions")
    f.add_argument("--manifest", default="configs/eval/gpu.json",
                   help="the files, their revisions and sha256 (scse_dist.data.eval_files)")
    f.add_argument("--out", required=True, help="a new directory for the prepared files")
    f.add_argument("--source", default=None, help="a local mirror DIR/<repo>/<path> instead of "
                   "the Hub (no network)")
    f.add_argument("--accept-unrecorded", action="store_true",
                   help="go on for a file whose sha256 the manifest does not record (printed)")
    f.set_defaults(func=cmd_fetch_eval)
    return p


@cli_main("scse-data")
def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 1 `inspect` found bad shards; 2 bad arguments; 65 bad input data
    (empty, not UTF-8, malformed JSON, a missing field, not a tokenizer); 66 an input is missing
    or unreadable. Errors are one line on stderr (scse_dist.cli_errors)."""
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
