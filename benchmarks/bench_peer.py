"""Training-step time against a peer, Hugging Face GPT-2: python benchmarks/bench_peer.py [--quick]

One training step (zero_grad, forward, loss, backward, AdamW step) of scse-dist's untied, looped,
additive and scse models against `transformers`' GPT2LMHeadModel (random init from a GPT2Config,
no download; `pip install -e .[bench]`) at equal width, unrolled depth, sequence and vocabulary.

Models (defaults as in issue 9): d 256, 4 heads, seq 256, batch 8, vocab 4096, fp32, 1 thread.
  looped / additive / scse   1 prelude + 1 core looped T = 6 times + 1 coda = 8 unrolled blocks
  untied                     1 prelude + 6 distinct core blocks + 1 coda     = 8 blocks
  gpt2                       n_layer 8, dropout 0, SDPA attention, tied head
Not identical blocks: ours are Post-LN (deeploop) RMSNorm + RoPE + SwiGLU (hidden 704, no biases),
GPT-2's are Pre-LN LayerNorm + learned positions + GELU MLP (hidden 1024, with biases); the FFN
FLOPs differ by 3% (3 x 256 x 704 vs 2 x 256 x 1024 multiply-adds per token).

Method: every model is warmed up, then timed in interleaved rounds, each round timing every model
once in an order rotated by one per round (so no model always runs first or after the same
neighbour). Printed per model: median step time, its spread (min - max over rounds), and its ratio
to GPT-2 as the median of the per-round ratios (models of one round see about the same load: this
is robust to other processes on a shared machine). The goals are printed PASS/MISS, never
asserted (a benchmark is not a timed test):
  untied <= 0.9 x gpt2          (eager against eager; compiled against compiled with --compile)
  looped <= 1.02 x untied       (same unrolled depth: the loop itself should cost nothing)
  scse   <= (T+1)/T x additive  (scse makes T + 1 core calls against T)
--compile runs both modes in one run: eager rounds, then torch.compile'd models (the optimizer
step stays eager). --profile N prints each model's top N ops (torch.profiler, one eager step).
--quick: tiny sizes and 2 rounds, a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig

RECURRENCES = ("untied", "looped", "additive", "scse")


@dataclass
class Sizes:
    d_model: int = 256
    n_heads: int = 4
    unrolled: int = 8  # blocks per forward: 1 prelude + T core visits + 1 coda
    seq: int = 256
    batch: int = 8
    vocab: int = 4096

    @property
    def loop_depth(self) -> int:
        return self.unrolled - 2


QUICK = Sizes(d_model=64, n_heads=2, unrolled=4, seq=32, batch=2, vocab=256)


def scse_dist_model(recurrence: str, sz: Sizes) -> LoopedLM:
    # depth = T for every kind: untied then has T distinct core blocks (untied_match=depth) and
    # the deeploop constants use the same unrolled depth N = T + 2 in all four.
    return LoopedLM(ModelConfig(vocab_size=sz.vocab, d_model=sz.d_model, n_heads=sz.n_heads,
                                max_seq_len=sz.seq, recurrence=recurrence, depth=sz.loop_depth))


def gpt2_model(sz: Sizes) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # the [bench] extra

    cfg = GPT2Config(vocab_size=sz.vocab, n_positions=sz.seq, n_embd=sz.d_model,
                     n_layer=sz.unrolled, n_head=sz.n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"  # the same attention kernel as ours
    return GPT2LMHeadModel(cfg)


def loss_fn(model: nn.Module, ours: bool, depth: int
            ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(inputs, targets) -> mean cross-entropy; the same F.cross_entropy for both libraries.
    `model` may be torch.compile's wrapper, hence `ours` rather than an isinstance check."""
    if ours:
        return lambda x, y: model(x, y, depth=depth, keep_logits=False).loss
    return lambda x, y: F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1),
                                        y.flatten())


class Contender:
    """One model, its AdamW and its (possibly compiled) forward: `step()` is one training step."""

    def __init__(self, name: str, model: nn.Module, depth: int, data: torch.Tensor) -> None:
        self.name = name
        self.model = model.train()
        self.depth = depth
        self.x, self.y = data[:, :-1], data[:, 1:]
        self.params = sum(p.numel() for p in model.parameters())
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        self.ours = isinstance(model, LoopedLM)
        self.loss = loss_fn(model, self.ours, depth)

    def compile(self) -> None:
        self.loss = loss_fn(torch.compile(self.model), self.ours, self.depth)

    def step(self) -> float:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.x, self.y).backward()
        self.opt.step()
        return time.perf_counter() - start


def build(sz: Sizes) -> list[Contender]:
    torch.manual_seed(0)
    data = torch.randint(0, sz.vocab, (sz.batch, sz.seq + 1),
                         generator=torch.Generator().manual_seed(0))
    out = [Contender("gpt2", gpt2_model(sz), 0, data)]
    out += [Contender(r, scse_dist_model(r, sz), sz.loop_depth, data) for r in RECURRENCES]
    return out


def interleaved(contenders: list[Contender], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Step times per model: round r times every model once, the order rotated by r."""
    for c in contenders:
        for _ in range(warmup):
            c.step()
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            times[c.name].append(c.step())
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b) in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def report(mode: str, contenders: list[Contender], times: dict[str, list[float]], T: int) -> None:
    print(f"[{mode}] {len(times['gpt2'])} rounds; step = zero_grad + forward + backward + AdamW")
    print(f"    {'model':<10}{'params':>10}{'median s':>10}{'min s':>9}{'max s':>9}{'x gpt2':>8}")
    for c in contenders:
        ts = times[c.name]
        print(f"    {c.name:<10}{c.params / 1e6:>9.2f}M{statistics.median(ts):>10.4f}"
              f"{min(ts):>9.4f}{max(ts):>9.4f}{paired_ratio(times, c.name, 'gpt2'):>8.3f}")
    goals = [("untied / gpt2", "untied", "gpt2", 0.9),
             ("looped / untied", "looped", "untied", 1.02),
             ("scse / additive", "scse", "additive", (T + 1) / T)]
    for label, a, b, bound in goals:
        r = paired_ratio(times, a, b)
        print(f"    goal {label:<17}{r:.3f} <= {bound:.3f}  {'PASS' if r <= bound else 'MISS'}")


def profile(contenders: list[Contender], top: int) -> None:
    """Where each model's step goes: torch.profiler's ops by self CPU time, one step each."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for c in contenders:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            c.step()
        print(f"[profile] {c.name}: top {top} ops by self CPU time, one step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                        max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke run)")
    parser.add_argument("--compile", action="store_true",
                        help="also time every model under torch.compile (after the eager rounds)")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default 15; quick 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and mode")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, print each model's top N ops (torch.profiler, eager)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    sz = QUICK if args.quick else Sizes()
    rounds = args.rounds or (2 if args.quick else 15)
    torch.set_num_threads(args.threads)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; {sz}, T = {sz.loop_depth}")
    contenders = build(sz)
    report("eager", contenders, interleaved(contenders, rounds, args.warmup), sz.loop_depth)
    if args.profile:
        profile(contenders, args.profile)
    if args.compile:
        for c in contenders:
            c.compile()
        # Compilation happens in the warm-up; one more step there so recompiles are also left out.
        report("compile", contenders, interleaved(contenders, rounds, args.warmup + 1),
               sz.loop_depth)


if __name__ == "__main__":
    main()
