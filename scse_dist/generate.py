"""Text generation: greedy, temperature and top-p sampling over LoopedLM.decode_step's KV cache.

    scse-generate EXPORT --prompt "Return the" [--depth T] [--exit RULE] [--max-new-tokens N]
                  [--temperature X --top-p P --seed S] [--cache exact|shared|none]
                  [--speculative DRAFT_DEPTH[,K]]

streams the continuation to the terminal. `--prompt-file F` generates for every line of F at once
(one left-padded batch); each sequence gets the tokens it would get alone. `--cache none`
recomputes the whole sequence for every new token (the reference the cache must equal).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence

import torch

from scse_dist.cli_errors import InputError, cli_main
from scse_dist.model.kv_cache import KVCache
from scse_dist.speculative import DEFAULT_DRAFT_TOKENS, parse_speculative, speculative_generate
from scse_dist.sampling import Generation, Sampling, left_pad, next_tokens  # noqa: F401 (API)

CACHE_CHOICES = ("exact", "shared", "none")
# --exit without --depth (and no max=) caps at this many times the model's depth: at the model's
# own depth a rule could only end tokens before the depth they would run anyway, never deeper.
EXIT_CAP_FACTOR = 8


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             depth: Optional[int] = None, sampling: Sampling = Sampling(),
             eos_id: Optional[int] = None, cache: str = "exact", exit_rule=None,
             on_token: Optional[Callable[[int, int], None]] = None,
             speculative: Optional[tuple[int, int]] = None,
             generator: Optional[torch.Generator] = None,
             stop: Optional[Callable[[int, list[int]], bool]] = None) -> Generation:
    """Continue every prompt (token ids, non-empty) by up to max_new_tokens, stopping a sequence
    at eos_id. cache: "exact" / "shared" (KVCache modes) or "none" (recompute the whole sequence
    for each token). on_token(row, token) is called for each new token as it is chosen.
    generator: sampling's random numbers (default: a new one seeded with sampling.seed).
    stop(row, new tokens) -> True also ends a row (a stop string: lm-eval's `until`).
    speculative=(d, K): self-speculative decoding (scse_dist.speculative), K tokens drafted at
    loop depth d per round; greedy gives the same tokens, sampling the same distribution."""
    if cache not in CACHE_CHOICES:
        raise ValueError(f"cache: must be one of {', '.join(CACHE_CHOICES)}; got {cache!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    if speculative is not None:
        if cache != "exact" or exit_rule is not None or generator is not None or stop:
            raise ValueError("speculative: runs with the exact cache and a fixed depth (no exit "
                             "rule, no shared or no cache, no generator or stop)")
        return speculative_generate(model, prompts, max_new_tokens=max_new_tokens,
                                    draft_depth=speculative[0], draft_tokens=speculative[1],
                                    depth=depth, sampling=sampling, eos_id=eos_id,
                                    on_token=on_token)
    device = next(model.parameters()).device
    tokens, mask = (t.to(device) for t in left_pad(prompts))
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    kv = KVCache(cache) if cache != "none" else None
    new: list[list[int]] = [[] for _ in prompts]
    steps: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    step_in, mask_in = tokens, mask
    for _ in range(max_new_tokens):
        if kv is None:  # the reference: a fresh cache over the whole sequence, used once
            out = model.decode_step(tokens, KVCache(), depth=depth, attention_mask=mask,
                                    exit_rule=exit_rule)
        else:
            out = model.decode_step(step_in, kv, depth=depth, attention_mask=mask_in,
                                    exit_rule=exit_rule)
        chosen = next_tokens(out.logits[:, -1], sampling, generator)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            new[row].append(token)
            steps[row].append(int(out.steps[row, -1]))
            if on_token is not None:
                on_token(row, token)
            done[row] = token == eos_id or (stop is not None and stop(row, new[row]))
        if all(done):
            break
        step_in, mask_in = chosen[:, None], torch.ones_like(chosen)[:, None]
        tokens, mask = torch.cat([tokens, step_in], 1), torch.cat([mask, mask_in], 1)
    return Generation(new, steps)


def continuation_text(tokenizer, prompt_ids: Sequence[int], new: Sequence[int]) -> str:
    """The text the new tokens add after the prompt: decoded together with the prompt, so the
    continuation keeps its leading space (a first new token '▁the' decodes alone as 'the')."""
    new = [t for t in new if t != tokenizer.eos_id]
    before, text = tokenizer.decode(list(prompt_ids)), tokenizer.decode(list(prompt_ids) + new)
    return text[len(before):] if text.startswith(before) else tokenizer.decode(new)


class TextStream:
    """Prints a sequence's continuation as tokens arrive (decoding prompt + continuation each
    time, so pieces that merge across tokens, and the first token's space, print right)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], out=None) -> None:
        self.tokenizer, self.prompt_ids = tokenizer, list(prompt_ids)
        self.out, self.ids, self.printed = out or sys.stdout, [], ""

    def __call__(self, row: int, token: int) -> None:
        if token == self.tokenizer.eos_id:
            return
        self.ids.append(token)
        text = continuation_text(self.tokenizer, self.prompt_ids, self.ids)
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scse-generate", description=__doc__.split("\n")[0])
    p.add_argument("export", help="export dir (model.safetensors, config.yaml, tokenizer.model; a "
                   "path or an fsspec URL) or a DeepSpeed checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", help="one prompt per line, generated as one batch")
    p.add_argument("--depth", type=int, default=None, help="loop depth T (default: the model's)")
    p.add_argument("--exit", default=None, help="per-token exit rule, e.g. motion:0.02,min=2; "
                   f"its cap: the rule's max=, else --depth, else {EXIT_CAP_FACTOR}x the model's "
                   "depth (a rule can only end a token early below its cap)")
    p.add_argument("--speculative", metavar="DRAFT_DEPTH[,K]", default=None,
                   help="self-speculative decoding: draft K tokens (default "
                   f"{DEFAULT_DRAFT_TOKENS}) at loop depth DRAFT_DEPTH, verify them at the full "
                   "depth in one call; the same tokens greedy, the same distribution sampled")
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


def _exit_rule(text: Optional[str]):
    if text is None:
        return None
    from scse_dist.model.exit_rules import parse_exit_rule

    try:
        return parse_exit_rule(text)
    except ValueError as exc:
        raise InputError(f"--exit: {exc}") from None


def _speculative(text: Optional[str]) -> Optional[tuple[int, int]]:
    if text is None:
        return None
    try:
        return parse_speculative(text)
    except ValueError as exc:
        raise InputError(f"--{exc}") from None


@cli_main("scse-generate")
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed)
    except ValueError as exc:
        raise InputError(f"--{exc}".replace("_", "-", 1)) from None
    exit_rule = _exit_rule(args.exit)
    speculative = _speculative(args.speculative)
    prompts = _read_prompts(args)
    from scse_dist.checkpoint.loading import load_model
    from scse_dist.eval.tasks import load_tokenizer
    from scse_dist.checkpoint.export import local_export

    with local_export(args.export) as path:
        model, cfg = load_model(path, device=args.device)
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg)
    ids = [tokenizer.encode(text) for text in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise InputError(f"prompt {i + 1}: encodes to no tokens")
    depth = args.depth if args.depth is not None else model.fixed_depth or cfg.model.depth
    try:
        model.core.transition.check_depth(depth)
    except ValueError as exc:
        raise InputError(f"--{exc}") from None
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


def _check_speculative(speculative: Optional[tuple[int, int]], depth: int,
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
        accepted = f"{spec['accepted'] / spec['drafted']:.0%}" if spec["drafted"] else "-"
        print(f"scse-generate: speculative {speculative[0]},{speculative[1]}: {accepted} of "
              f"{spec['drafted']} drafted tokens accepted, {tokens / spec['rounds']:.2f} tokens "
              f"per verification, {tokens / seconds:.1f} tokens/s", file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
