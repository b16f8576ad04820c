"""Text generation: greedy, temperature and top-p sampling over LoopedLM.decode_step's KV cache.

    scse-generate EXPORT --prompt "Return the" [--depth T] [--exit RULE] [--max-new-tokens N]
                  [--temperature X --top-p P --seed S] [--cache exact|shared|none]

streams the continuation to the terminal. `--prompt-file F` generates for every line of F at once
(one left-padded batch); each sequence gets the tokens it would get alone. `--cache none`
recomputes the whole sequence for every new token (the reference the cache must equal).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from scse_dist.cli_errors import InputError, cli_main
from scse_dist.model.kv_cache import KVCache

CACHE_CHOICES = ("exact", "shared", "none")


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: sample from the smallest set of tokens with this much mass
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must lie in (0, 1], got {self.top_p}")


class Generation(NamedTuple):
    tokens: list[list[int]]  # new tokens per sequence, up to and including EOS
    steps: list[list[int]]  # loop steps each new token's input ran (its exit step under a rule)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, attention_mask), both (B, max_len): prompts right-aligned, padding masked."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return tokens, mask


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
                ) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / sampling.temperature).softmax(-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             depth: Optional[int] = None, sampling: Sampling = Sampling(),
             eos_id: Optional[int] = None, cache: str = "exact", exit_rule=None,
             on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
    """Continue every prompt (token ids, non-empty) by up to max_new_tokens, stopping a sequence
    at eos_id. cache: "exact" / "shared" (KVCache modes) or "none" (recompute the whole sequence
    for each token). on_token(row, token) is called for each new token as it is chosen."""
    if cache not in CACHE_CHOICES:
        raise ValueError(f"cache: must be one of {', '.join(CACHE_CHOICES)}; got {cache!r}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    device = next(model.parameters()).device
    tokens, mask = (t.to(device) for t in left_pad(prompts))
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
            done[row] = token == eos_id
        if all(done):
            break
        step_in, mask_in = chosen[:, None], torch.ones_like(chosen)[:, None]
        tokens, mask = torch.cat([tokens, step_in], 1), torch.cat([mask, mask_in], 1)
    return Generation(new, steps)


class TextStream:
    """Prints a sequence's text as tokens arrive (decoding the whole continuation each time, so
    pieces that merge across tokens print correctly)."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out or sys.stdout, [], ""

    def __call__(self, row: int, token: int) -> None:
        if token == self.tokenizer.eos_id:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
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
    p.add_argument("--exit", default=None, help="per-token exit rule, e.g. motion:0.02,min=2")
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
    try:
        model.core.transition.check_depth(
            args.depth if args.depth is not None else model.fixed_depth or cfg.model.depth)
    except ValueError as exc:
        raise InputError(f"--{exc}") from None
    single = len(prompts) == 1
    stream = TextStream(tokenizer) if single else None
    if single:
        print(prompts[0], end="", flush=True)
    result = generate(model, ids, max_new_tokens=args.max_new_tokens, depth=args.depth,
                      sampling=sampling, eos_id=tokenizer.eos_id, cache=args.cache,
                      exit_rule=exit_rule, on_token=stream)
    if single:
        print()
    else:
        for i, (text, new) in enumerate(zip(prompts, result.tokens)):
            continuation = tokenizer.decode([t for t in new if t != tokenizer.eos_id])
            print(f"[{i + 1}] {text}{continuation}")
    if exit_rule is not None:
        used = [s for row in result.steps for s in row]
        print(f"scse-generate: exit {exit_rule}: mean loop steps per token "
              f"{sum(used) / len(used):.2f} (min {min(used)}, max {max(used)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
