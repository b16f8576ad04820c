"""Generation with the loop-step KV cache: speed against prefix length, and the shared mode's cost.

1. Greedy tokens per CPU-second (1 thread) after a prefix of L tokens, with the exact cache (each
   new token: one token at depth T, +1 core call for scse) and without one (the whole sequence
   recomputed per token). The cached rate should stay about flat in L; the uncached one falls
   roughly as 1/L.
2. Held-out likelihood of teacher-forced incremental decoding (every token fed one at a time
   through the cache, the next one scored) with the `shared` cache (one slot per core block,
   memory constant in T) against `exact`, at several depths: mean NLL, perplexity and their ratio.
   `exact` is also checked against one full forward over the same rows (it must agree).
3. Self-speculative decoding (scse_dist.generate.speculative), batch 1, measured side by side with
   cached full-depth decoding in one run: tokens per CPU-second over --spec-new-tokens tokens at
   depth --spec-depth, for each draft depth d and K drafted tokens per round, greedy (the tokens
   must be identical) and sampled (temperature 1, the model's own distribution), with the
   acceptance rate
   and tokens per round; K is each of --draft-tokens, `auto` among them (K adapted per round,
   scse_dist.generate.AdaptiveDraft; its mean K printed); and "a plain model": an untied model of
   equal unrolled depth and width, random-init (only its speed is used), decoded through the same
   cache.

    python benchmarks/bench_generate.py                      # runs/quickstart/export if present
    python benchmarks/bench_generate.py EXPORT_OR_RUN_DIR --prefixes 32,128,512,1024 --depths 4,8,32
    python benchmarks/bench_generate.py --device cuda --dtype bf16 --size gpt2-small  # GPU timing
    python benchmarks/bench_generate.py EXPORT --parts 3 --spec-depth 8 --spec-new-tokens 256

Without a model (no argument and no quickstart export) part 1 runs on a random-init model of the
quickstart's size and part 2 is skipped (a random model's likelihood says nothing).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scse_dist.model import LoopedLM, ModelConfig  # noqa: E402
from scse_dist.model.kv_cache import KVCache  # noqa: E402

QUICKSTART_EXPORT = REPO / "runs" / "quickstart" / "export"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="export or run dir (default: "
                   "runs/quickstart/export when it exists)")
    p.add_argument("--prefixes", default="32,128,512,1024")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--depth", type=int, default=None, help="depth for part 1 (default: model's)")
    p.add_argument("--depths", default="4,8,32", help="depths for part 2")
    p.add_argument("--rows", type=int, default=8, help="held-out rows for part 2")
    p.add_argument("--threads", type=int, default=1, help="1: rates are tokens per CPU-second")
    p.add_argument("--device", default="cpu", help="cpu (CPU-seconds) or cuda (wall seconds)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--size", default="quickstart", choices=sorted(RANDOM_SIZES),
                   help="the random-init model's size when no export is given")
    p.add_argument("--batch", type=int, default=1, help="sequences generated at once")
    p.add_argument("--parts", default="1,2,3", help="which parts to run")
    p.add_argument("--spec-depth", type=int, default=8, help="part 3: the full depth T")
    p.add_argument("--spec-new-tokens", type=int, default=256)
    p.add_argument("--draft-depths", default="1,2", help="part 3: draft depths d")
    p.add_argument("--draft-tokens", default="2,4,8,auto", help="part 3: tokens drafted per "
                   "round K, each an integer, auto or auto:MAX (K adapted per round)")
    p.add_argument("--repeats", type=int, default=3, help="part 3: alternating runs per row")
    p.add_argument("--spec-prompt-tokens", type=int, default=32,
                   help="part 3: the prompt, the start of a held-out row (random without one)")
    return p.parse_args(argv)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Random-init timing models: the quickstart's size, and GPT-2 small's
# (configs/gpt2-small-scse.yaml).
RANDOM_SIZES = {"quickstart": dict(d_model=128, n_heads=4, depth=4),
                "gpt2-small": dict(vocab_size=32000, d_model=768, n_heads=12, n_prelude=2,
                                   n_core=2, n_coda=2, depth=4, max_seq_len=2048)}


def clock(device: torch.device) -> float:
    """CPU time of this process on CPU (robust to shared cores); wall time after a sync on GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


@torch.no_grad()
def tokens_per_second(model: LoopedLM, prefix: torch.Tensor, n: int, depth: int, cached: bool
                      ) -> float:
    seq = prefix
    if cached:
        cache = KVCache("exact")
        logits = model.decode_step(prefix, cache, depth=depth).logits  # the prefill: not timed
    else:
        logits = model(prefix, depth=depth).logits
    start = clock(prefix.device)
    for _ in range(n):
        nxt = logits[:, -1:].argmax(-1)
        if cached:
            logits = model.decode_step(nxt, cache, depth=depth).logits
        else:
            seq = torch.cat([seq, nxt], 1)
            logits = model(seq, depth=depth).logits
    return n * prefix.shape[0] / (clock(prefix.device) - start)


@torch.no_grad()
def incremental_nll(model: LoopedLM, rows: torch.Tensor, depth: int, mode: str) -> float:
    """Mean NLL of rows[:, 1:] given the tokens before, fed one token at a time through a cache."""
    cache, total = KVCache(mode), 0.0
    for i in range(rows.shape[1] - 1):
        logits = model.decode_step(rows[:, i:i + 1], cache, depth=depth).logits[:, 0]
        total += F.cross_entropy(logits.float(), rows[:, i + 1], reduction="sum").item()
    return total / (rows.shape[0] * (rows.shape[1] - 1))


@torch.no_grad()
def forward_nll(model: LoopedLM, rows: torch.Tensor, depth: int) -> float:
    logits = model(rows[:, :-1], depth=depth).logits
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()).item()


def timed_generation(model: LoopedLM, prompt: list[int], n: int, depth: int, sampling,
                     speculative=None):
    """(Generation, tokens per CPU-second) of one batch-1 run of n new tokens."""
    from scse_dist.generate import generate

    start = clock(next(model.parameters()).device)
    out = generate(model, [prompt], max_new_tokens=n, depth=depth, sampling=sampling,
                   speculative=speculative)
    return out, n / (clock(next(model.parameters()).device) - start)


def plain_model_rate(model: LoopedLM, prompt: list[int], n: int, depth: int) -> float:
    """Greedy tokens/s of an untied model as deep (unrolled) and wide as `model` at `depth`."""
    from dataclasses import replace

    torch.manual_seed(0)
    cfg = replace(model.cfg, recurrence="untied", untied_match="depth", depth=depth,
                  inject="default")
    plain = LoopedLM(cfg).to(next(model.parameters()).device).eval()
    return timed_generation(plain, prompt, n, depth, sampling_of(0.0))[1]


def sampling_of(temperature: float):
    from scse_dist.generate import Sampling

    return Sampling(temperature=temperature, seed=0)


def side_by_side(model: LoopedLM, prompt: list[int], args: argparse.Namespace, temperature: float,
                 speculative) -> tuple[float, float, object, object]:
    """Cached full depth and speculative decoding run alternately args.repeats times (a shared
    machine's load shifts within seconds): (median full-depth tokens/s, median of the per-pair
    speed-ups, the full-depth Generation, the speculative one)."""
    rates, ratios = [], []
    for _ in range(args.repeats):
        ref, base = timed_generation(model, prompt, args.spec_new_tokens, args.spec_depth,
                                     sampling_of(temperature))
        out, rate = timed_generation(model, prompt, args.spec_new_tokens, args.spec_depth,
                                     sampling_of(temperature), speculative)
        rates.append(base)
        ratios.append(rate / base)
    return sorted(rates)[len(rates) // 2], sorted(ratios)[len(ratios) // 2], ref, out


def speculative_table(model: LoopedLM, prompt: list[int], args: argparse.Namespace) -> None:
    depth, n = args.spec_depth, args.spec_new_tokens
    print(f"\n3. self-speculative decoding: batch 1, depth {depth}, {n} new tokens, prompt of "
          f"{len(prompt)} tokens; tokens per CPU-second, each row's full-depth and speculative "
          f"runs alternating, median of {args.repeats}")
    print(f"{'decoding':>9} {'d':>3} {'K':>7} {'mean K':>7} {'cached':>8} {'spec':>8} "
          f"{'speed-up':>9} {'accepted':>9} {'tok/round':>10} {'same tokens':>12}")
    bases = []
    for temperature in (0.0, 1.0):
        kind = "greedy" if temperature == 0 else "sampled"
        for d in [int(x) for x in args.draft_depths.split(",")]:
            for k in args.draft_tokens:
                base, ratio, ref, out = side_by_side(model, prompt, args, temperature, (d, k))
                bases.append(base)
                spec = out.speculation
                same = ("yes" if out.tokens == ref.tokens else "NO") if temperature == 0 \
                    else "(sampled)"
                print(f"{kind:>9} {d:>3} {str(k):>7} {spec['mean_k']:>7.2f} {base:>8.1f} "
                      f"{base * ratio:>8.1f} {ratio:>8.2f}x "
                      f"{spec['accepted'] / spec['drafted']:>9.2f} {n / spec['rounds']:>10.2f} "
                      f"{same:>12}")
    base = sorted(bases)[len(bases) // 2]
    plain = plain_model_rate(model, prompt, n, depth)
    print(f"a plain model (untied, "
          f"{model.cfg.n_prelude + model.cfg.n_core * depth + model.cfg.n_coda}"
          f" blocks, random-init: its speed only), greedy, cached: {plain:.1f} tokens/s, "
          f"{plain / base:.2f}x the looped model's median cached rate {base:.1f}")


def draft_token_choices(text: str) -> list:
    """--draft-tokens "2,4,auto" -> [2, 4, AdaptiveDraft()] (K as --speculative D,K reads it)."""
    from scse_dist.generate import parse_speculative

    choices = []
    for k in text.split(","):
        try:
            choices.append(parse_speculative(f"1,{k}")[1])
        except ValueError:
            sys.exit(f"bench_generate.py: --draft-tokens: {k!r} is not a K (a positive integer, "
                     "auto or auto:MAX)")
    return choices


def heldout_rows(cfg, n: int) -> torch.Tensor:
    from scse_dist.eval.inputs import read_task_data

    rows = []
    for batch in read_task_data("heldout", cfg.data, cfg.model, cfg.eval.batch_size,
                                cfg.data.path).inputs:
        rows += list(batch)
        if len(rows) >= n:
            break
    return torch.stack(rows[:n])


def cache_table(model: LoopedLM, args: argparse.Namespace, device: torch.device) -> None:
    depth = args.depth or model.fixed_depth or model.cfg.depth
    unit = "wall second" if device.type == "cuda" else "CPU-second"
    print(f"\n1. greedy tokens per {unit} after a prefix of L tokens, depth {depth}, batch "
          f"{args.batch}, {args.new_tokens} new tokens, {args.dtype} on {device}")
    print(f"{'L':>6} {'exact cache':>12} {'no cache':>10} {'speed-up':>9}")
    gen = torch.Generator().manual_seed(0)
    for length in [int(x) for x in args.prefixes.split(",")]:
        prefix = torch.randint(0, model.cfg.vocab_size, (args.batch, length), generator=gen)
        prefix = prefix.to(device)
        cached = tokens_per_second(model, prefix, args.new_tokens, depth, cached=True)
        plain = tokens_per_second(model, prefix, args.new_tokens, depth, cached=False)
        print(f"{length:>6} {cached:>12.1f} {plain:>10.1f} {cached / plain:>8.1f}x")


def shared_cache_table(model: LoopedLM, cfg, args: argparse.Namespace, device: torch.device
                       ) -> None:
    rows = heldout_rows(cfg, args.rows).to(device)
    print(f"\n2. held-out NLL, teacher-forced one token at a time through the cache "
          f"({rows.shape[0]} rows x {rows.shape[1] - 1} predictions)")
    print(f"{'T':>4} {'forward ppl':>12} {'exact ppl':>10} {'shared ppl':>11} "
          f"{'NLL shared/exact':>17} {'ppl shared/exact':>17}")
    for t in [int(x) for x in args.depths.split(",")]:
        full = forward_nll(model, rows, t)
        exact, shared = (incremental_nll(model, rows, t, mode) for mode in ("exact", "shared"))
        print(f"{t:>4} {math.exp(full):>12.3f} {math.exp(exact):>10.3f} {math.exp(shared):>11.3f} "
              f"{shared / exact:>17.4f} {math.exp(shared - exact):>17.4f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.draft_tokens = draft_token_choices(args.draft_tokens)  # a bad K: before the model loads
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.set_flush_denormal(True)
    path = args.model or (str(QUICKSTART_EXPORT) if QUICKSTART_EXPORT.exists() else None)
    if path is not None:
        from scse_dist.checkpoint.loading import load_model

        model, cfg = load_model(path)
        model = model.to(device, DTYPES[args.dtype]).eval()
        print(f"model: {path} ({cfg.model.recurrence}, d {cfg.model.d_model}, "
              f"{model.num_parameters() / 1e6:.2f}M params)")
    else:
        torch.manual_seed(0)
        model = LoopedLM(ModelConfig(**RANDOM_SIZES[args.size])).to(device, DTYPES[args.dtype])
        model, cfg = model.eval(), None
        print(f"model: random-init, {args.size} size ({model.num_parameters() / 1e6:.1f}M params, "
              "no export given): timing only")
    parts = {int(x) for x in args.parts.split(",")}
    if 1 in parts:
        cache_table(model, args, device)
    if cfg is not None and 2 in parts:
        shared_cache_table(model, cfg, args, device)
    if 3 in parts:
        gen = torch.Generator().manual_seed(0)
        prompt = heldout_rows(cfg, 1)[0, :args.spec_prompt_tokens].tolist() if cfg is not None \
            else torch.randint(0, model.cfg.vocab_size, (args.spec_prompt_tokens,),
                               generator=gen).tolist()
        speculative_table(model, prompt, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
