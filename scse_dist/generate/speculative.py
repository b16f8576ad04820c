"""Self-speculative decoding (docs/using-the-model.md): a looped model drafts K tokens with its own
first d loop steps (scse_dist.model.speculative.draft), verifies them at the full depth T in one
call (verify), keeps the longest prefix the verifier agrees with plus one token of the
verifier's, and truncates the rejected drafts from the cache.

The rule is the standard speculative-sampling one: a drafted y drawn from the draft's q is kept
with probability min(1, p(y) / q(y)), else the token is drawn from max(p - q, 0) normalised, so
every token is distributed exactly as p (greedy: exactly full-depth greedy's tokens). A batch
shares one cache length, so a round keeps, in every row, the fewest drafts any unfinished row
kept; K is fixed before a round's drafts are drawn, so AdaptiveDraft keeps the output exact.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from scse_dist.generate.options import DEFAULT_DRAFT_TOKENS, AdaptiveDraft, DraftTokens
from scse_dist.generate.sampling import Generation, Sampling, left_pad, token_probs
from scse_dist.model.kv_cache import KVCache
from scse_dist.model.speculative import Drafted, check_draft_depth, draft, verify


def accept(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule over one round, batched.

    p (B, K+1, V): the verifier's distributions at the K+1 positions; q (B, K, V): the draft's at
    the first K; drafted (B, K): the drafted tokens (drawn from q). Returns kept (B,): how many
    leading drafts each row keeps, and correction (B, K+1): the token at position i if a row
    stops there: drawn from max(p - q, 0) normalised for i < K, from p at K."""
    b, k = drafted.shape
    ratio = p[:, :k].gather(-1, drafted[..., None]).squeeze(-1) / \
        q.gather(-1, drafted[..., None]).squeeze(-1)
    uniform = torch.rand(b, k, generator=generator, device=p.device)
    kept = (uniform < ratio).long().cumprod(-1).sum(-1)
    residual = torch.cat([(p[:, :k] - q).clamp(min=0), p[:, k:]], dim=1)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass, and then the draft is never rejected: any row will do
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    correction = torch.multinomial(residual.flatten(0, 1), 1, generator=generator).view(b, k + 1)
    return kept, correction


def _judge(logits: torch.Tensor, q: list[torch.Tensor], drafted: torch.Tensor,
           sampling: Sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """accept's (kept, correction) from the verifier's logits (B, K+1, V). Greedy is the same
    rule with one-hot p and q, done on the argmax alone (no (K+1) x V distributions built)."""
    if sampling.temperature == 0:
        best = logits.argmax(-1)
        kept = (drafted == best[:, :drafted.shape[1]]).long().cumprod(-1).sum(-1)
        return kept, best
    p = token_probs(logits, sampling)
    return accept(p, torch.stack(q, 1) if q else p[:, :0], drafted, generator)


@torch.no_grad()
def speculative_generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                         draft_depth: int, draft_tokens: DraftTokens = DEFAULT_DRAFT_TOKENS,
                         depth: Optional[int] = None, sampling: Sampling = Sampling(),
                         eos_id: Optional[int] = None, on_token=None) -> Generation:
    """generate's tokens with drafts of `draft_tokens` (K, or AdaptiveDraft) at `draft_depth`;
    the result's `speculation` counts rounds, drafted and accepted tokens, and mean_k."""
    schedule = draft_tokens if isinstance(draft_tokens, AdaptiveDraft) else None
    k_next = draft_tokens.start if isinstance(draft_tokens, AdaptiveDraft) else draft_tokens
    if k_next < 1:
        raise ValueError(f"speculative: K (drafted tokens per round) must be >= 1, got "
                         f"{draft_tokens}")
    depth = depth if depth is not None else model.fixed_depth or model.cfg.depth
    model.core.transition.check_depth(depth)  # an untied model runs only its fixed depth
    check_draft_depth(draft_depth, depth)
    device = next(model.parameters()).device
    pending, mask = (t.to(device) for t in left_pad(prompts))
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = KVCache("exact")
    rows = len(prompts)
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * rows
    counts: dict[str, float] = {"rounds": 0, "drafted": 0, "accepted": 0}
    k_sum = 0
    while not all(done) and len(new[done.index(False)]) < max_new_tokens:
        remaining = max_new_tokens - len(new[done.index(False)])
        k = min(k_next, remaining - 1)
        drafts, q, drafted = _draft_round(model, pending, mask, cache, draft_depth, depth, k,
                                          sampling, generator)
        start = len(cache) - sum(d.x.shape[1] for d in drafts)
        logits = verify(model, drafts, cache, draft_depth)[:, pending.shape[1] - 1:]
        kept, correction = _judge(logits, q, drafted, sampling, generator)
        a = _batch_kept(kept, drafted, done, eos_id, k)
        if schedule is not None:
            k_next = schedule.next(k_next, a == k)
        k_sum += k
        counts["rounds"] += 1
        counts["drafted"] += k * done.count(False)
        counts["accepted"] += sum(int(kept[r]) for r in range(rows) if not done[r])
        last = correction[:, a]
        if a < k:  # rows that kept draft a+1 too take it
            last = torch.where(kept > a, drafted[:, a], last)
        chosen = torch.cat([drafted[:, :a], last[:, None]], dim=1)
        _emit(chosen.tolist(), new, done, eos_id, on_token)
        cache.truncate(start + pending.shape[1] + a)
        pending, mask = last[:, None], torch.ones_like(last)[:, None]
    counts["mean_k"] = k_sum / max(counts["rounds"], 1)
    return Generation(new, [[depth] * len(row) for row in new], counts)


def _draft_round(model, pending: torch.Tensor, mask: torch.Tensor, cache: KVCache,
                 draft_depth: int, depth: int, k: int, sampling: Sampling,
                 generator: torch.Generator
                 ) -> tuple[list[Drafted], list[torch.Tensor], torch.Tensor]:
    """The pending tokens and k drafted ones (the last too: verify starts from its first steps)
    through the draft: the drafts, q at each drafted position and the drafted tokens (B, k)."""
    drafts = [draft(model, pending, cache, draft_depth, depth, mask, readout=k > 0)]
    q, drafted = [], []
    for i in range(k):
        assert drafts[-1].logits is not None  # k > 0: read out
        logits = drafts[-1].logits[:, -1]
        if sampling.temperature > 0:  # greedy needs no q (_judge)
            q.append(token_probs(logits, sampling))
            drafted.append(torch.multinomial(q[-1], 1, generator=generator).squeeze(-1))
        else:
            drafted.append(logits.argmax(-1))
        drafts.append(draft(model, drafted[-1][:, None], cache, draft_depth, depth,
                            readout=i + 1 < k))
    tokens = torch.stack(drafted, 1) if drafted else pending.new_zeros(pending.shape[0], 0)
    return drafts, q, tokens


def _batch_kept(kept: torch.Tensor, drafted: torch.Tensor, done: list[bool],
                eos_id: Optional[int], k: int) -> int:
    """Drafts every row keeps this round: the fewest an unfinished row kept, a row whose kept
    drafts hold its EOS not counting (it ends inside them)."""
    fewest = k
    for row, n in enumerate(kept.tolist()):
        ends = eos_id is not None and eos_id in drafted[row, :n].tolist()
        if not done[row] and not ends:
            fewest = min(fewest, n)
    return fewest


def _emit(chosen: list[list[int]], new: list[list[int]], done: list[bool],
          eos_id: Optional[int], on_token) -> None:
    """Append each unfinished row's tokens of this round, up to and including its EOS."""
    for row, tokens in enumerate(chosen):
        for token in tokens:
            if done[row]:
                break
            new[row].append(token)
            if on_token is not None:
                on_token(row, token)
            done[row] = token == eos_id
