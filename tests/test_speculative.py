"""Self-speculative decoding (scse_dist.generate.speculative, scse_dist.model.speculative).

Greedy: the very tokens of full-depth cached decoding, on every recurrence, in padded batches,
with an EOS inside a draft, at a fixed K and with K adapted per round (AdaptiveDraft, `auto`).
Sampled: the distribution of full-depth sampling (chi-square against the exact probabilities,
also with auto; a sampler that skips the rejection rule must fail the same test).
The draft's work is reused: every position passes each core block T (+1 for scse) times in all,
never more, and a round verifies its K+1 positions in one call."""

from __future__ import annotations

import re

import pytest
import torch

from scse_dist.generate import (
    AdaptiveDraft,
    Sampling,
    generate,
    parse_speculative,
    speculative,
    token_probs,
)
from scse_dist.generate.speculative import accept
from scse_dist.model import LoopedLM, ModelConfig
from scse_dist.model.kv_cache import KVCache
from scse_dist.model.speculative import draft

DEPTH = 4
# preln (and scse's concat inject, and a deeploop scse with its weights shaken below): tiny
# random models whose greedy tokens vary and whose shallow drafts disagree with the full depth
# often enough to exercise rejection (a deeploop model at init repeats one token).
KINDS = [dict(recurrence="untied", residual="preln"), dict(recurrence="looped", residual="preln"),
         dict(recurrence="additive", residual="preln"), dict(recurrence="scse", residual="preln"),
         dict(recurrence="scse", inject="concat"), dict(recurrence="scse"),
         dict(recurrence="scse", anchor_scale="free")]


def kind_id(kw: dict) -> str:
    return "-".join(map(str, kw.values()))


def model_of(vocab: int = 64, depth: int = DEPTH, **kw) -> LoopedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=64,
                      n_prelude=1, n_core=2, n_coda=1, depth=depth, init_std=0.3, **kw)
    model = LoopedLM(cfg).eval()
    if cfg.residual == "deeploop":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    return model


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_greedy_equals_full_depth_greedy(kw: dict) -> None:
    model = model_of(**kw)
    batch = prompts(7, 3, 5)  # left-padded
    want = generate(model, batch, max_new_tokens=16, depth=DEPTH)
    assert min(len(set(row)) for row in want.tokens) >= 4  # not one repeated token
    accepted = []
    for d, k in [(1, 3), (2, 4), (3, 2), (1, 1), (1, AdaptiveDraft()), (2, AdaptiveDraft(1, 6))]:
        got = generate(model, batch, max_new_tokens=16, depth=DEPTH, speculative=(d, k))
        assert got.tokens == want.tokens, (d, k)
        assert got.steps == want.steps
        accepted.append(got.speculation["accepted"] / got.speculation["drafted"])
        alone = generate(model, batch[1:2], max_new_tokens=16, depth=DEPTH, speculative=(d, k))
        assert alone.tokens == want.tokens[1:2], (d, k)
    assert 0 < min(accepted) and max(accepted) < 1  # some drafts kept, some rejected


def test_eos_inside_a_draft_ends_the_row_there() -> None:
    model = model_of(**KINDS[3])
    batch = prompts(6, 4)
    free = generate(model, batch, max_new_tokens=14, depth=DEPTH)
    eos = free.tokens[0][5]
    want = generate(model, batch, max_new_tokens=14, depth=DEPTH, eos_id=eos)
    assert want.tokens[0] == free.tokens[0][:free.tokens[0].index(eos) + 1]
    for d, k in [(2, 8), (3, 4), (1, 2), (1, AdaptiveDraft()), (3, AdaptiveDraft(1, 8))]:
        got = generate(model, batch, max_new_tokens=14, depth=DEPTH, eos_id=eos, speculative=(d, k))
        assert got.tokens == want.tokens, (d, k)
    # with every draft kept (d close to T), the EOS arrives inside a round's drafts
    for k in (8, AdaptiveDraft(6)):
        assert generate(model, batch[:1], max_new_tokens=14, depth=DEPTH, eos_id=eos,
                        speculative=(3, k)).tokens == want.tokens[:1]


@pytest.mark.parametrize("kw", [KINDS[3], KINDS[1]], ids=kind_id)
def test_draft_is_the_model_at_the_draft_depth(kw: dict) -> None:
    """The draft (first d steps, its own coda slots) gives the logits of decoding at depth d."""
    model = model_of(**kw)
    seq = torch.tensor(prompts(9))
    spec, plain = KVCache(), KVCache()
    for lo, hi in [(0, 6), (6, 7), (7, 9)]:
        got = draft(model, seq[:, lo:hi], spec, 2, DEPTH).logits
        want = model.decode_step(seq[:, lo:hi], plain, depth=2).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kw", [KINDS[3], KINDS[1], KINDS[0]], ids=kind_id)
def test_verification_reuses_the_drafts_steps(kw: dict) -> None:
    """Tokens through the core blocks: every position processed (kept or rejected) passes each
    core block core_calls(T) times in all, as in plain decoding: the verifier never recomputes
    the draft's steps (nor scse's r*); and each round verifies in one call of K+1 positions."""
    model = model_of(**kw)
    seen: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
             for b in model.core.blocks]
    verified: list[int] = []
    coda = model.coda[0].register_forward_pre_hook(
        lambda _, args: verified.append(args[0].shape[1]))
    out = generate(model, prompts(5), max_new_tokens=13, depth=DEPTH, speculative=(1, 3))
    for h in hooks + [coda]:
        h.remove()
    rounds, drafted = out.speculation["rounds"], out.speculation["drafted"]
    positions = 5 + (rounds - 1) + drafted  # the prompt, then each round's pending + drafts
    assert sum(seen) == positions * model.core.n_core * model.core.core_calls(DEPTH)
    # the coda: once per draft call (the pending tokens, each drafted one), once per round's
    # verification, over all its positions: the prompt + 3 drafts first, then 1 + 3
    assert len(verified) == drafted + 2 * rounds
    assert verified[:6] == [5, 1, 1, 1, 8, 1] and verified.count(4) >= 1


def test_accept_rule_gives_the_verifiers_distribution() -> None:
    """The rule alone, 200,000 rows at once: the token at each position is distributed as p
    there, whatever q proposed (chi-square, p-value > 1e-3)."""
    gen = torch.Generator().manual_seed(0)
    b, k, v = 200_000, 2, 6
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3],
                      [0.3, 0.0, 0.3, 0.0, 0.2, 0.2]]).expand(b, k + 1, v)
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.2, 0.2], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]]
                     ).expand(b, k, v)
    drafted = torch.multinomial(q.reshape(-1, v), 1, generator=gen).view(b, k)
    kept, correction = accept(p, q, drafted, gen)
    first = torch.where(kept > 0, drafted[:, 0], correction[:, 0])
    assert chi2_p_value(first, p[0, 0]) > 1e-3
    second_rows = kept > 0  # the chain reached position 2
    second = torch.where(kept > 1, drafted[:, 1], correction[:, 1])[second_rows]
    assert chi2_p_value(second, p[0, 1]) > 1e-3
    assert chi2_p_value(correction[kept == 2, 2], p[0, 2]) > 1e-3
    # the test has power: the drafts themselves (q) fail it
    assert chi2_p_value(drafted[:, 0], p[0, 0]) < 1e-6


def chi2_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of integer samples to probs (cells of zero
    probability must be empty: any sample there gives 0)."""
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    expected = probs.double() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    live = expected > 0
    stat = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@torch.no_grad()
def exact_pair_probs(model: LoopedLM, prompt: list[int], sampling: Sampling, depth: int,
                     at: int = 0) -> torch.Tensor:
    """P(new tokens at, at+1 = (i, j)) under sampling at `depth`, (V * V,): every sequence of
    the first at+1 new tokens enumerated with its probability, the first `at` summed out."""
    v = model.cfg.vocab_size
    rows, weights = torch.tensor([prompt]), torch.ones(1)
    for _ in range(at + 1):
        probs = token_probs(model(rows, depth=depth).logits[:, -1], sampling)  # (N, V)
        weights = (weights[:, None] * probs).flatten()
        rows = torch.cat([rows.repeat_interleave(v, 0), torch.arange(v).repeat(len(rows))[:, None]],
                         dim=1)
    last = token_probs(model(rows, depth=depth).logits[:, -1], sampling)  # (N * V, V)
    return (weights[:, None] * last).view(-1, v, v).sum(0).flatten()


SAMPLED_MODEL = dict(vocab=6, depth=3, recurrence="scse", residual="preln")


@pytest.mark.slow
@pytest.mark.parametrize("draft_tokens, rows, runs, new_tokens", [
    (2, 8, 400, 2), (AdaptiveDraft(1, 4), 2, 1600, 5)], ids=["K=2", "auto"])
def test_sampling_is_exact_in_distribution(draft_tokens, rows: int, runs: int,
                                           new_tokens: int) -> None:
    """The last two of new_tokens sampled tokens of 3,200 rows (seeded runs of identical
    prompts): their joint distribution fits full-depth sampling's exact one (chi-square over the
    V^2 cells, the rare ones pooled), at drafts deep enough to keep many and shallow enough to
    reject some. With auto, K grows in the runs whose rounds kept every draft: the tokens after
    the first round come from rounds of different K, and stay exact (K looks only backwards)."""
    model = model_of(**SAMPLED_MODEL)
    prompt = [1, 4, 2]
    want = exact_pair_probs(model, prompt, Sampling(temperature=1.5), 3, at=new_tokens - 2)
    pairs, kept, drafted, mean_k = [], 0, 0, set()
    for seed in range(runs):
        out = generate(model, [prompt] * rows, max_new_tokens=new_tokens, depth=3,
                       speculative=(1, draft_tokens), sampling=Sampling(temperature=1.5, seed=seed))
        pairs += [row[-2] * 6 + row[-1] for row in out.tokens]
        kept, drafted = kept + out.speculation["accepted"], drafted + out.speculation["drafted"]
        mean_k.add(out.speculation["mean_k"])
    assert len(pairs) == 3200
    assert 0.2 < kept / drafted < 0.95  # both branches of the rule ran
    if isinstance(draft_tokens, AdaptiveDraft):
        assert max(mean_k) > 1 and len(mean_k) > 2  # K grew in some runs, not in others
    assert pooled_p_value(torch.tensor(pairs), want) > 1e-3


def test_chi_square_catches_a_sampler_without_the_rule() -> None:
    """The test above has power: the depth-1 draft's own tokens (no rejection rule) fail it."""
    model = model_of(**SAMPLED_MODEL)
    prompt, sampling = [1, 4, 2], Sampling(temperature=1.5)
    first = exact_pair_probs(model, prompt, sampling, 3).view(6, 6).sum(1)
    draft_probs = token_probs(draft(model, torch.tensor([prompt]), KVCache(), 1, 3).logits[0, -1],
                              sampling)
    assert not torch.allclose(draft_probs, first, atol=0.02)
    gen = torch.Generator().manual_seed(0)
    wrong = torch.multinomial(draft_probs, 3200, replacement=True, generator=gen)
    assert pooled_p_value(wrong, first) < 1e-6


def pooled_p_value(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
                   ) -> float:
    """chi2_p_value with the cells expected to hold fewer than min_expected samples pooled."""
    n = samples.numel()
    small = probs * n < min_expected
    if not bool(small.any()):
        return chi2_p_value(samples, probs)
    index = torch.cumsum(~small, 0) - 1  # big cells keep their order; the small ones -> last
    index[small] = int((~small).sum())
    pooled = torch.zeros(int(index.max()) + 1, dtype=probs.dtype).index_add_(0, index, probs)
    return chi2_p_value(index[samples], pooled)


def test_bad_speculative_arguments_are_one_clear_error() -> None:
    model = model_of(**KINDS[1])
    assert parse_speculative("2") == (2, 4) and parse_speculative("1,8") == (1, 8)
    assert parse_speculative("1,auto") == (1, AdaptiveDraft(4, 32))
    assert parse_speculative("2,auto:16") == (2, AdaptiveDraft(4, 16))
    assert parse_speculative("2,auto:2") == (2, AdaptiveDraft(2, 2))  # starts at the cap
    form = r"speculative: expected DRAFT_DEPTH\[,K\|,auto\[:MAX\]\]; "
    for text, field, bad in [("0,4", "DRAFT_DEPTH", "0"), ("a", "DRAFT_DEPTH", "a"),
                             ("", "DRAFT_DEPTH", ""), ("2,0", "K", "0"), ("1,2,3", "K", "2,3"),
                             ("1,", "K", ""), ("1,auto:0", "K", "auto:0"),
                             ("1,Auto", "K", "Auto"), ("1,auto:", "K", "auto:")]:
        with pytest.raises(ValueError) as error:
            parse_speculative(text)
        assert re.fullmatch(form + f"{field} must be a positive integer.*, got '{re.escape(bad)}' "
                            f"in '{re.escape(text)}'", str(error.value)), str(error.value)
    with pytest.raises(ValueError, match=r"draft depth must lie in 1..3 \(below the depth 4\), "
                                         "got 4"):
        generate(model, prompts(3), max_new_tokens=2, speculative=(4, 2))
    untied = model_of(**KINDS[0])
    with pytest.raises(ValueError, match="has the fixed depth 4, got 5"):
        generate(untied, prompts(3), max_new_tokens=2, depth=5, speculative=(1, 2))
    with pytest.raises(ValueError, match="speculative: runs with the exact cache"):
        generate(model, prompts(3), max_new_tokens=2, speculative=(1, 2), cache="shared")


def test_adaptive_draft_schedule() -> None:
    schedule = AdaptiveDraft(start=4, max=7)
    assert [schedule.next(k, True) for k in (1, 4, 6, 7)] == [3, 6, 7, 7]
    assert [schedule.next(k, False) for k in (1, 2, 7)] == [1, 1, 6]
    assert str(AdaptiveDraft()) == "auto" and str(schedule) == "auto:7"
    with pytest.raises(ValueError, match=r"auto's start K must lie in 1..max \(3\), got 4"):
        AdaptiveDraft(4, 3)


@pytest.mark.parametrize("d, reaches_cap", [(3, True), (1, False)])
def test_auto_k_grows_after_full_acceptance_and_shrinks_after_a_rejection(
        monkeypatch, d: int, reaches_cap: bool) -> None:
    """Each round's K (the drafts verify gets) and drafts kept (a), recorded: K starts at 2,
    then K + 2 (at most 5) after a round that kept all K, else K - 1 (at least 1), never more
    than the tokens left minus one; mean_k is their mean. Both branches run; a depth-3 draft of
    depth 4 is kept often enough for K to reach the cap, a depth-1 draft is not."""
    rounds: list[list[int]] = []  # [K, a] per round
    real_verify, real_kept = speculative.verify, speculative._batch_kept
    monkeypatch.setattr(speculative, "verify", lambda model, drafts, *rest: (
        rounds.append([len(drafts) - 1]), real_verify(model, drafts, *rest))[1])
    monkeypatch.setattr(speculative, "_batch_kept", lambda *args: (
        rounds[-1].append(real_kept(*args)), rounds[-1][-1])[1])
    model = model_of(**KINDS[3])
    out = generate(model, prompts(5, 3), max_new_tokens=30, depth=DEPTH,
                   speculative=(d, AdaptiveDraft(2, 5)))
    assert out.tokens == generate(model, prompts(5, 3), max_new_tokens=30, depth=DEPTH).tokens
    made, k = 0, 2
    for got_k, a in rounds:
        assert got_k == min(k, 30 - made - 1)
        made += a + 1
        k = min(k + 2, 5) if a == got_k else max(k - 1, 1)
    assert made == 30 and out.speculation["rounds"] == len(rounds)
    assert out.speculation["mean_k"] == pytest.approx(sum(r[0] for r in rounds) / len(rounds))
    ks = [r[0] for r in rounds]
    assert any(y > x for x, y in zip(ks, ks[1:])) and any(y < x for x, y in zip(ks, ks[1:]))
    assert (max(ks) == 5) == reaches_cap  # depth 3 of 4 drafts well enough to reach the cap


def test_a_round_never_passes_max_new_tokens() -> None:
    model = model_of(**KINDS[3])
    for n in (1, 2, 5, 9):
        got = generate(model, prompts(4, 2), max_new_tokens=n, depth=DEPTH, speculative=(3, 4))
        assert [len(r) for r in got.tokens] == [n, n]
        assert got.tokens == generate(model, prompts(4, 2), max_new_tokens=n, depth=DEPTH).tokens
