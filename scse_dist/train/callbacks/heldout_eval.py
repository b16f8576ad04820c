"""Held-out loss at eval.depths during training, as rows of their own
(`"kind": "eval"`, docs/monitoring.md).

Every rank evaluates its share of the held-out split without gradients; the summed NLL and token
counts are all-reduced. eval.max_batches counts batches over all ranks. The ranks run the same
number of forwards, which ZeRO-3's gathers need. At world size 1 the numbers equal `scse-eval
--task heldout`'s on a checkpoint of that step (scse_dist.eval.perplexity.evaluate_heldout).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, cast

from scse_dist.run_dir import EVAL_KIND
from scse_dist.train.callbacks.base import Cadence, Callback, TrainState, every, reduce_totals

if TYPE_CHECKING:  # torch in the functions only: config checks import this module
    import torch


def agreed_batches(batches: Iterator[torch.Tensor], limit: int, device: torch.device
                   ) -> Iterator[torch.Tensor]:
    """Up to `limit` (0: no limit) batches, while every rank still has one: one tiny all-reduce
    per batch keeps the ranks' forward counts equal."""
    import torch

    from scse_dist.train.step import sum_over_ranks

    for _ in (range(limit) if limit else itertools.count()):
        batch = next(batches, None)
        ran_out = sum_over_ranks(torch.tensor([float(batch is None)], device=device))
        if float(ran_out) > 0:
            return
        assert batch is not None  # this rank counted itself into ran_out otherwise
        yield batch


def forward_rows(model: torch.nn.Module, batches: Iterator[torch.Tensor], depths: list[int],
                 eos_id: Optional[int] = None) -> list[dict]:
    """evaluate_heldout's rows through the model's own forward (loss_by_depth), for ZeRO-3, whose
    hooks gather the LM head only inside the forward (the scorer reads it outside)."""
    import torch

    nll = {d: 0.0 for d in depths}
    tokens, was_training = 0, model.training
    untied = getattr(model, "fixed_depth", None) is not None
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = batch.to(next(model.parameters()).device)
                n = int(batch[:, 1:].ne(-100).sum())
                docs = None if eos_id is None else \
                    cast(Any, model).documents(batch[:, :-1], eos_id)  # a LoopedLM
                if untied:  # its own depth only; it cannot read out others
                    losses = {depths[0]: model(batch[:, :-1], batch[:, 1:], keep_logits=False,
                                               document_ids=docs).loss}
                else:
                    losses = model(batch[:, :-1], batch[:, 1:], depth=max(depths),
                                   readout_depths=depths, keep_logits=False,
                                   document_ids=docs).loss_by_depth
                for d in depths:  # mean CE x token count = summed NLL
                    nll[d] += float(losses[d].double()) * n
                tokens += n
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("held-out evaluation: the batches held no tokens")
    from scse_dist.eval.perplexity import heldout_rows

    return heldout_rows(depths, nll, tokens)


def reduce_rows(rows: list[dict], device: torch.device) -> list[dict]:
    """Per-depth rows of one rank -> the same rows over every rank (token-weighted mean loss)."""
    from scse_dist.eval.perplexity import heldout_rows

    summed = reduce_totals([{"depth": r["depth"], "nll": r["loss"] * r["tokens"],
                             "tokens": r["tokens"]} for r in rows], device)
    return heldout_rows([t["depth"] for t in summed], {t["depth"]: t["nll"] for t in summed},
                        int(summed[0]["tokens"]))


class HeldoutEvalCallback(Callback):
    Config = Cadence  # every_steps: held-out loss at eval.depths (0: off)
    priority = 200

    def __init__(self, config: Cadence) -> None:
        self.every_steps = config.every_steps
        self.depths: list[int] = []

    def for_run(self) -> bool:
        return self.every_steps > 0

    def on_start(self, state: TrainState) -> None:
        fixed: Optional[int] = getattr(state.engine.module, "fixed_depth", None)  # untied: its own
        self.depths = [fixed] if fixed is not None else sorted(set(state.cfg.eval.depths))
        self._stream(state)  # a missing or too small held-out split fails now, not at step N

    def _stream(self, state: TrainState):
        from scse_dist.data.stream import TokenStream

        cfg, env = state.cfg, state.env
        return TokenStream(cfg.data.path, split="heldout", seq_len=cfg.data.seq_len,
                           batch_size=cfg.eval.batch_size, rank=env.rank,
                           world_size=env.world_size, seed=0, loop=False,
                           tokenizer_sha256=state.tokenizer.sha256)

    def on_step_end(self, state: TrainState) -> None:
        if every(self.every_steps, state.step):
            self.evaluate(state)

    def evaluate(self, state: TrainState) -> dict:
        from scse_dist.eval.perplexity import evaluate_heldout

        start = time.perf_counter()
        device = state.engine.device
        world = state.env.world_size
        limit = -(-state.cfg.eval.max_batches // world)  # ceil; 0 stays 0 (the whole split)
        batches = agreed_batches(iter(self._stream(state)), limit, device)
        eos_id = state.tokenizer.eos_id  # model.document_mask: scored as it trains
        if state.engine.zero_optimization_stage() == 3:
            rows = forward_rows(state.engine.module, batches, self.depths, eos_id)
        else:
            rows = evaluate_heldout(state.engine.module, batches, self.depths, eos_id=eos_id)
        if world > 1:
            rows = reduce_rows(rows, device)
        row: dict = {"step": state.step, "kind": EVAL_KIND, "task": "heldout"}
        for r in rows:
            row[f"heldout_loss_T{r['depth']}"] = r["loss"]
            row[f"heldout_ppl_T{r['depth']}"] = r["ppl"]
        row.update(tokens=rows[0]["tokens"], eval_time_s=time.perf_counter() - start)
        if state.rank0:
            losses = " | ".join(f"T{r['depth']} {r['loss']:.4f}" for r in rows)
            print(f"eval step {state.step:>6d} | heldout loss {losses} | "
                  f"{row['eval_time_s']:.2f} s", flush=True)
        state.logger.write(row)
        return row
