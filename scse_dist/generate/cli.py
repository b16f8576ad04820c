"""`scse-generate`: continue a prompt with a model, streaming the text to the terminal.

    scse-generate EXPORT --prompt "Return the" [--depth T] [--exit RULE] [--max-new-tokens N]
                  [--temperature X --top-p P --seed S] [--cache exact|shared|none]
                  [--speculative DRAFT_DEPTH[,K|,auto[:MAX]]]

`--prompt-file F` generates for every line of F at once (one left-padded batch); each sequence
gets the tokens it would get alone. `--cache none` recomputes the whole sequence for every new
token (the reference the cache must equal). The arguments and prompts are checked before torch
is imported (scse_dist.generate.core, the library, imports it).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from scse_dist.cli_errors import InputError, cli_main, command_parser
from scse_dist.generate.options import (
    CACHE_CHOICES,
    DEFAULT_DRAFT_TOKENS,
    EXIT_CAP_FACTOR,
    MAX_DRAFT_TOKENS,
    SPECULATIVE_FORM,
    DraftTokens,
    Sampling,
    parse_speculative,
)
from scse_dist.model.exit_rules import parse_exit_rule

if TYPE_CHECKING:
    from scse_dist.generate.sampling import Generation


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = command_parser("scse-generate", __doc__)
    p.add_argument("export", help="export dir (model.safetensors, config.yaml, the tokenizer; a "
                   "path or an fsspec URL) or a DeepSpeed checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", help="one prompt per line, generated as one batch")
    p.add_argument("--depth", type=int, default=None, help="loop depth T (default: the model's)")
    p.add_argument("--exit", default=None, help="per-token exit rule, e.g. motion:0.02,min=2; "
                   f"its cap: the rule's max=, else --depth, else {EXIT_CAP_FACTOR}x the model's "
                   "depth (a rule can only end a token early below its cap)")
    p.add_argument("--speculative", metavar=SPECULATIVE_FORM, default=None,
                   help="self-speculative decoding: draft K tokens (default "
                   f"{DEFAULT_DRAFT_TOKENS}) at loop depth DRAFT_DEPTH, verify them at the full "
                   "depth in one call; the same tokens greedy, the same distribution sampled. "
                   "auto: K adapted per round (+2 after a round that kept every draft, else -1), "
                   f"up to MAX (default {MAX_DRAFT_TOKENS})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=CACHE_CHOICES, default="exact")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        prompts = [args.prompt]
    else:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError:
            raise InputError(f"{args.prompt_file}: not UTF-8 text") from None
        if not prompts:
            raise InputError(f"{args.prompt_file}: holds no prompt (one per non-blank line)")
    for i, text in enumerate(prompts):
        if not text.strip():
            where = "--prompt" if args.prompt is not None else f"{args.prompt_file}:{i + 1}"
            raise InputError(f"{where}: the prompt is empty; give some text to continue")
    return prompts


def _checked(value: Any, check: Callable[[Any], Any], prefix: str) -> Any:
    """check(value), None for None; a ValueError as one line, `prefix` + its message."""
    try:
        return None if value is None else check(value)
    except ValueError as exc:
        raise InputError(f"{prefix}{exc}") from None


@cli_main("scse-generate")
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise InputError(f"--{exc}".replace("_", "-", 1)) from None
    exit_rule = _checked(args.exit, parse_exit_rule, "--exit: ")
    speculative = _checked(args.speculative, parse_speculative, "--")
    prompts = _read_prompts(args)
    from scse_dist.checkpoint.export import local_export
    from scse_dist.checkpoint.loading import device_flag, load_model
    from scse_dist.eval.inputs import load_tokenizer

    with local_export(args.export) as path:  # a missing or bad path fails before torch loads
        model, cfg = load_model(path, device=device_flag(args.device))
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data, cfg.model)
    from scse_dist.generate.core import generate
    from scse_dist.generate.text import TextStream, continuation_text
    from scse_dist.threads import configure_threads

    configure_threads()  # as scse-eval: no busy-waiting threads beyond the free cores
    ids = [tokenizer.encode(text) for text in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise InputError(f"prompt {i + 1}: encodes to no tokens")
    depth = args.depth if args.depth is not None else model.fixed_depth or cfg.model.depth
    _checked(depth, model.core.transition.check_depth, "--")
    exit_rule = _exit_cap(exit_rule, args.depth, model)
    _check_speculative(speculative, depth, args)
    single = len(prompts) == 1
    stream = TextStream(tokenizer, ids[0]) if single else None
    if single:
        print(prompts[0], end="", flush=True)
    start = time.perf_counter()
    result = generate(model, ids, max_new_tokens=args.max_new_tokens, depth=args.depth,
                      sampling=sampling, eos_id=tokenizer.eos_id, cache=args.cache,
                      exit_rule=exit_rule, on_token=stream, speculative=speculative)
    seconds = time.perf_counter() - start
    if single:
        print()
    else:
        for i, (text, new) in enumerate(zip(prompts, result.tokens)):
            print(f"[{i + 1}] {text}{continuation_text(tokenizer, ids[i], new)}")
    _report(result, exit_rule, speculative, seconds)
    return 0


def _exit_cap(rule, depth: Optional[int], model):
    """The rule with its cap: its own max=, else --depth, else EXIT_CAP_FACTOR x the model's."""
    if rule is None or rule.max_steps is not None or depth is not None \
            or model.fixed_depth is not None:
        return rule
    return rule.with_max(EXIT_CAP_FACTOR * model.cfg.depth)


def _check_speculative(speculative: Optional[tuple[int, DraftTokens]], depth: int,
                       args: argparse.Namespace) -> None:
    if speculative is None:
        return
    if args.exit is not None or args.cache != "exact":
        raise InputError("--speculative: runs with the exact cache at a fixed depth; drop "
                         "--exit and --cache")
    if speculative[0] >= depth:
        raise InputError(f"--speculative: the draft depth must lie in 1..{depth - 1} (below "
                         f"the depth {depth}), got {speculative[0]}")


def _report(result: Generation, exit_rule, speculative, seconds: float) -> None:
    """One line on stderr: an exit rule's steps used; speculation's acceptance and speed."""
    if exit_rule is not None:
        used = [s for row in result.steps for s in row]
        print(f"scse-generate: exit {exit_rule}: mean loop steps per token "
              f"{sum(used) / len(used):.2f} (min {min(used)}, max {max(used)})", file=sys.stderr)
    if speculative is not None:
        spec, tokens = result.speculation, sum(len(row) for row in result.tokens)
        assert spec is not None  # a speculative run counts its rounds
        accepted = f"{spec['accepted'] / spec['drafted']:.0%}" if spec["drafted"] else "-"
        print(f"scse-generate: speculative {speculative[0]},{speculative[1]}: {accepted} of "
              f"{spec['drafted']} drafted tokens accepted, mean K {spec['mean_k']:.2f}, "
              f"{tokens / spec['rounds']:.2f} tokens per verification, {tokens / seconds:.1f} "
              "tokens/s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
