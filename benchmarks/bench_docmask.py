"""Step time of document-masked attention over the causal mask: python benchmarks/bench_docmask.py

One training step (forward and backward at loop depth T, the chunked loss, no optimizer) of
one SCSE model on packed rows whose documents have a mean length of --doc-len tokens (lengths
drawn from a geometric distribution, each document opened by eos, as the loader packs them),
two variants side by side in one run, in interleaved rounds with a rotating order:
  causal   document_ids=None: SDPA is_causal over the whole row (model.document_mask off)
  docmask  document_ids from the row's eos tokens: the mask documents.py builds for the device
           (CPU: SDPA with a (B, 1, S, S) bool mask; CUDA: FlexAttention), made once per step
           and read by every block at every loop step
Prints each variant's median step time and the median of the per-round ratios docmask / causal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.model.documents import backend_for, document_ids

EOS = 2


def packed_rows(batch: int, seq: int, doc_len: float, vocab: int,
                gen: torch.Generator) -> torch.Tensor:
    """(batch, seq + 1) tokens: documents of geometric length (mean doc_len) end to end."""
    tokens = torch.randint(3, vocab, (batch, seq + 1), generator=gen)
    starts = torch.rand(batch, seq + 1, generator=gen) < 1.0 / doc_len
    return tokens.masked_fill(starts, EOS)


def step(model: LoopedLM, window: torch.Tensor, depth: int, masked: bool) -> None:
    inputs, targets = window[:, :-1], window[:, 1:]
    docs = document_ids(inputs, EOS) if masked else None
    out = model(inputs, targets, depth=depth, keep_logits=False, document_ids=docs)
    assert out.loss is not None
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--doc-len", type=float, default=64.0, help="mean document length")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=args.d_model, n_heads=args.d_model // 32,
                      max_seq_len=args.seq, depth=args.depth, document_mask=True)
    model = LoopedLM(cfg).to(device)
    window = packed_rows(args.batch, args.seq, args.doc_len, cfg.vocab_size,
                         torch.Generator().manual_seed(0)).to(device)
    docs = int((window[:, :-1] == EOS).sum()) + args.batch
    times: dict[str, list[float]] = {"causal": [], "docmask": []}
    for masked in (False, True):  # warm-up (and FlexAttention's compile on CUDA)
        step(model, window, args.depth, masked)
    for r in range(args.rounds):
        for name in (("causal", "docmask") if r % 2 == 0 else ("docmask", "causal")):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, window, args.depth, name == "docmask")
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    ratios = [m / c for m, c in zip(times["docmask"], times["causal"])]
    print(f"torch {torch.__version__}, {args.device} ({args.threads} thread(s)), docmask through "
          f"{backend_for(device)}; d {args.d_model}, seq {args.seq}, batch {args.batch}, "
          f"T {args.depth}, {docs} documents (mean length {args.batch * args.seq / docs:.0f})")
    for name, ts in times.items():
        print(f"    {name:<8} median step {statistics.median(ts) * 1e3:8.1f} ms")
    print(f"    docmask / causal step time: {statistics.median(ratios):.3f} (median of "
          f"{args.rounds} rounds, min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
