"""Generation with the loop-step KV cache (scse_dist.model.kv_cache, scse_dist.generate).

The exact cache must be token-identical to recomputing without one, for every recurrence; a
left-padded batch must give each prompt its own tokens; the shared cache's memory must not grow
with T; a new token must cost T core calls (+1 for scse), not a re-run of the prefix; in bf16 (the
GPU's precision) the cache and speculative decoding follow the full forward up to rounding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, TINY_VOCAB
from scse_dist.generate import Sampling, continuation_text, generate
from scse_dist.generate.cli import main as generate_main
from scse_dist.model import LoopedLM, ModelConfig
from scse_dist.model.exit_rules import ExitRule, parse_exit_rule
from scse_dist.model.kv_cache import KVCache, causal_mask

KINDS = [dict(recurrence="untied"), dict(recurrence="looped"), dict(recurrence="additive"),
         dict(recurrence="scse"), dict(recurrence="scse", inject="concat"),
         dict(recurrence="scse", residual="preln")]
DEPTH = 3


def kind_id(kw: dict) -> str:
    return "-".join(map(str, kw.values()))


def tiny_model(depth: int = DEPTH, **kw) -> LoopedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=64,
                      n_prelude=1, n_core=2, n_coda=1, depth=depth, **kw)
    return LoopedLM(cfg).eval()


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def greedy_without_cache(model: LoopedLM, prompt: list[int], n: int) -> list[int]:
    tokens = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(tokens, depth=DEPTH).logits[:, -1].argmax(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_exact_cache_equals_recomputing(kw: dict) -> None:
    model = tiny_model(**kw)
    (prompt,) = prompts(7)
    out = generate(model, [prompt], max_new_tokens=8, depth=DEPTH, cache="exact")
    assert out.tokens[0] == greedy_without_cache(model, prompt, 8)
    assert out.steps[0] == [DEPTH] * 8
    assert generate(model, [prompt], max_new_tokens=8, depth=DEPTH, cache="none") == out
    # logits: a prefill then one token at a time equals one forward over the whole sequence
    seq = torch.tensor([prompt + out.tokens[0]])
    cache = KVCache("exact")
    with torch.no_grad():
        parts = [model.decode_step(seq[:, :7], cache, depth=DEPTH).logits]
        parts += [model.decode_step(seq[:, i:i + 1], cache, depth=DEPTH).logits
                  for i in range(7, seq.shape[1])]
        full = model(seq, depth=DEPTH).logits
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
    assert len(cache) == seq.shape[1]


@pytest.mark.parametrize("bf16", ["weights", "autocast"])
@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_bf16_cache_and_speculative_decoding_follow_the_full_forward(kw: dict, bf16: str) -> None:
    """bf16 on CPU, as a GPU runs it (a bf16 model, or fp32 under autocast): the cached decode's
    logits are the full forward's up to bf16 rounding, and every token greedy decoding and
    self-speculative decoding emit is the full forward's argmax up to that rounding (bf16 breaks
    exact ties, so tokens are checked against logits, not against each other)."""
    model = tiny_model(**kw)
    model = model.to(torch.bfloat16) if bf16 == "weights" else model
    (prompt,) = prompts(7)
    # measured: at most 0.0039 (one bf16 step at these logits' scale, <= 0.78); the chosen
    # tokens' logits equal the maximum. The tie-breaking margin (top-1 minus top-2): >= 0.044.
    atol = 0.01
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16 == "autocast"), torch.no_grad():
        for decoding in (dict(cache="exact"), dict(speculative=(1, 3))):
            tokens = generate(model, [prompt], max_new_tokens=8, depth=DEPTH, **decoding).tokens[0]
            seq = torch.tensor([prompt + tokens])
            full = model(seq, depth=DEPTH).logits.float()
            chosen = full[0, len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            below_max = full[0, len(prompt) - 1:-1].max(-1).values - chosen
            assert float(below_max.max()) <= atol, (decoding, below_max)
        cache = KVCache("exact")
        parts = [model.decode_step(seq[:, :7], cache, depth=DEPTH).logits]
        parts += [model.decode_step(seq[:, i:i + 1], cache, depth=DEPTH).logits
                  for i in range(7, seq.shape[1])]
    assert full.abs().max() < 1  # the scale atol is set for
    torch.testing.assert_close(torch.cat(parts, 1).float(), full, rtol=0, atol=atol)


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_left_padded_batch_generates_what_each_prompt_does_alone(kw: dict) -> None:
    model = tiny_model(**kw)
    batch = prompts(9, 2, 5)
    sampling = Sampling(temperature=0.0)
    together = generate(model, batch, max_new_tokens=6, depth=DEPTH, sampling=sampling)
    for i, prompt in enumerate(batch):
        alone = generate(model, [prompt], max_new_tokens=6, depth=DEPTH, sampling=sampling)
        assert together.tokens[i] == alone.tokens[0], i


def test_sampling_is_seeded_and_stops_at_eos() -> None:
    model = tiny_model(recurrence="scse")
    batch = prompts(4, 6)
    hot = Sampling(temperature=1.0, top_p=0.9, seed=5)
    a = generate(model, batch, max_new_tokens=10, depth=DEPTH, sampling=hot)
    assert a == generate(model, batch, max_new_tokens=10, depth=DEPTH, sampling=hot)
    assert a != generate(model, batch, max_new_tokens=10, depth=DEPTH,
                         sampling=Sampling(temperature=1.0, top_p=0.9, seed=6))
    assert a.tokens != generate(model, batch, max_new_tokens=10, depth=DEPTH).tokens  # not greedy
    # a sequence stops at its EOS (kept as its last token); the others run on
    eos = a.tokens[0][2]
    stopped = generate(model, batch, max_new_tokens=10, depth=DEPTH, sampling=hot, eos_id=eos)
    first = a.tokens[0].index(eos)
    assert stopped.tokens[0] == a.tokens[0][:first + 1]
    # top_p that keeps only the most likely token is greedy
    narrow = Sampling(temperature=1.0, top_p=1e-6, seed=5)
    assert generate(model, batch, max_new_tokens=5, depth=DEPTH, sampling=narrow).tokens == \
        generate(model, batch, max_new_tokens=5, depth=DEPTH).tokens


@pytest.mark.parametrize("kw", [k for k in KINDS if k["recurrence"] != "untied"], ids=kind_id)
def test_shared_cache_memory_is_constant_in_depth(kw: dict) -> None:
    (prompt,) = prompts(10)
    held = {}
    for mode in ("exact", "shared"):
        for depth in (2, 6):
            model = tiny_model(depth=depth, **kw)
            cache = KVCache(mode)
            with torch.no_grad():
                model.decode_step(torch.tensor([prompt]), cache)
                model.decode_step(torch.tensor([[3]]), cache)
            held[mode, depth] = (len(cache.tensors()), cache.nbytes())
    assert held["shared", 2] == held["shared", 6]
    extra = 1 if kw["recurrence"] == "scse" else 0  # r*'s slot per core block
    slots = 2 * (1 + 1 + 2 * (1 + extra))  # k and v of prelude, coda, each core block (+ r*)
    assert held["shared", 6][0] == slots
    per_slot = 11 * 32 * 4  # 11 tokens x d_model x fp32
    assert held["exact", 6] == (2 * (2 + 2 * (6 + extra)), (2 + 2 * (6 + extra)) * 2 * per_slot)
    assert held["exact", 6][1] > held["exact", 2][1]


@pytest.mark.parametrize("kw", KINDS, ids=kind_id)
def test_a_new_token_costs_one_token_at_depth_t(kw: dict) -> None:
    """Tokens through each core block per generated token = core calls at depth T, counted with
    forward hooks: T for every kind, T+1 for scse (r*), whatever the prefix length."""
    model = tiny_model(**kw)
    seen: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[:-1].numel()))
             for b in model.core.blocks]
    cache = KVCache("exact")
    with torch.no_grad():
        model.decode_step(torch.tensor(prompts(20)), cache)
        for token in (5, 6):
            seen.clear()
            model.decode_step(torch.tensor([[token]]), cache)
            assert sum(seen) == model.core.n_core * model.core.core_calls(DEPTH)
            assert set(seen) == {1}
    for h in hooks:
        h.remove()
    assert model.core.core_calls(DEPTH) == DEPTH + (kw["recurrence"] == "scse")


class ExitWhenSumPositive(ExitRule):
    """A per-token exit rule whose decisions do not hinge on near-ties (as motion:tau's may): a
    token exits after a step whose deviation sums to > 0, so tokens exit at different steps."""

    def __init__(self) -> None:
        super().__init__("fixed")

    def exited(self, step, d_prev, d_new, logp_prev=None, logp_new=None) -> torch.Tensor:
        return (d_new.float().sum(-1) > 0) | (step >= 5)


@pytest.mark.parametrize("mode", ["exact", "shared"])
@pytest.mark.parametrize("kw", [dict(recurrence="scse"), dict(recurrence="looped")], ids=kind_id)
def test_exit_aware_cache_matches_the_teacher_forced_exit(kw: dict, mode: str) -> None:
    """A token that exits at step e keeps its state, and its step-e K/V stand in for later steps:
    one token at a time through the cache equals the whole sequence in one call (where exited rows
    freeze inside the batch), including in the slots of steps the loop never ran."""
    model = tiny_model(depth=5, **kw)
    rule = ExitWhenSumPositive()
    seq = torch.tensor(prompts(12))
    with torch.no_grad():
        whole = model.decode_step(seq, KVCache(mode), exit_rule=rule)
        cache = KVCache(mode)
        parts = [model.decode_step(seq[:, i:i + 1], cache, exit_rule=rule) for i in range(12)]
    steps = torch.cat([p.steps for p in parts], 1)
    assert torch.equal(steps, whole.steps)
    assert 1 < len(set(steps.flatten().tolist()))  # tokens exit at different steps
    if mode == "exact":
        torch.testing.assert_close(torch.cat([p.logits for p in parts], 1), whole.logits,
                                   rtol=0, atol=1e-5)
        fixed = model.decode_step(seq, KVCache(mode), depth=5).logits
        assert not torch.allclose(fixed, whole.logits)  # exiting changed something


@pytest.mark.parametrize("rule, kw", [("motion:0.5,min=2", dict(recurrence="scse")),
                                      ("motion:0.5,min=2", dict(recurrence="additive")),
                                      ("kl:0.001,min=2", dict(recurrence="scse"))])
def test_generation_under_an_exit_rule_equals_recomputing(rule: str, kw: dict) -> None:
    """An exit rule through the exact cache gives the tokens and exit steps of recomputing the
    whole sequence under the same rule (the teacher-forced adaptive forward) at every token; kl
    reads out every step through the cached coda."""
    model = tiny_model(depth=6, **kw)
    rule = parse_exit_rule(rule)
    batch = prompts(6, 3)
    cached = generate(model, batch, max_new_tokens=6, exit_rule=rule)
    assert cached == generate(model, batch, max_new_tokens=6, exit_rule=rule, cache="none")
    used = [s for row in cached.steps for s in row]
    assert min(used) >= 2 and max(used) <= 6 and sum(used) < 6 * len(used)  # some exit early
    with torch.no_grad():
        seq = torch.tensor([batch[0] + cached.tokens[0][:-1]])
        forward = model(seq, exit_rule=rule)
    assert forward.logits[0, len(batch[0]) - 1:].argmax(-1).tolist() == cached.tokens[0]
    assert forward.steps_used[0, len(batch[0]) - 1:].tolist() == cached.steps[0]


def test_one_new_tokens_mask_is_the_general_causal_mask() -> None:
    """KVCache.positions' short path for one new token (each generated one) gives the general
    mask exactly: over cached padding, after a truncation, for a real and a padding new token."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache()
    for new in ([[1], [1], [1]], [[1], [0], [1]], [[0], [1], [1]]):
        if cache.key_mask is None:
            cache.commit(torch.rand(3, 6, generator=gen).gt(0.3).long())
        keys = torch.cat([cache.key_mask, torch.tensor(new).bool()], dim=1)
        got = cache.positions(torch.tensor(new))[1]
        assert got.shape == (3, 1, 1, 7) and torch.equal(got, causal_mask(keys, 1))
        cache.commit(torch.tensor(new))
        cache.truncate(6)
    empty = KVCache().positions(torch.tensor([[1], [0]]))[1]
    assert torch.equal(empty, causal_mask(torch.tensor([[True], [False]]), 1))


def test_cache_refuses_another_depth_or_batch() -> None:
    model = tiny_model(recurrence="scse")
    cache = KVCache()
    with torch.no_grad():
        model.decode_step(torch.tensor(prompts(4)), cache, depth=3)
        with pytest.raises(ValueError, match="holds 3 loop steps, got depth=4"):
            model.decode_step(torch.tensor([[1]]), cache, depth=4)
        with pytest.raises(ValueError, match="holds a batch of 1 rows, got 2"):
            model.decode_step(torch.tensor([[1], [2]]), cache, depth=3)
    with pytest.raises(ValueError, match="cache mode"):
        KVCache("compressed")


# ---------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_data):
    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.config import config_from_dict

    cfg = config_from_dict({"name": "tiny", "data": {"seq_len": 16},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 32, "depth": 2}})
    torch.manual_seed(0)
    return save_exported_model(LoopedLM(cfg.model).state_dict(), cfg,
                               str(tmp_path_factory.mktemp("gen") / "export"),
                               tokenizer=tiny_data["tokenizer"])


def expected_text(export: str, prompt: str, **kw) -> str:
    from scse_dist.checkpoint.export import load_exported_model
    from scse_dist.data.tokenizer import Tokenizer

    model, cfg = load_exported_model(export)
    tok = Tokenizer.load(cfg.data.tokenizer)
    out = generate(model, [tok.encode(prompt)], eos_id=tok.eos_id, **kw)
    return prompt + continuation_text(tok, tok.encode(prompt), out.tokens[0])


def test_scse_generate_streams_seeded_text(export, subprocess_env, capsys) -> None:
    argv = [export, "--prompt", "the cat sees", "--max-new-tokens", "7", "--temperature", "1",
            "--top-p", "0.95", "--seed", "3"]
    run = subprocess.run([sys.executable, "-m", "scse_dist.generate.cli", *argv],
                         capture_output=True, text=True, env=subprocess_env, cwd=REPO_ROOT,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    want = expected_text(export, "the cat sees", max_new_tokens=7,
                         sampling=Sampling(1.0, 0.95, 3))
    assert run.stdout == want + "\n"
    assert len(run.stdout) > len("the cat sees\n")
    assert generate_main(argv) == 0  # same seed, same text
    assert capsys.readouterr().out == run.stdout
    assert generate_main(argv[:-1] + ["4"]) == 0
    assert capsys.readouterr().out != run.stdout


def test_scse_generate_prompt_file_is_one_batch(export, tmp_path, capsys) -> None:
    lines = ["the cat sees", "a small bird follows the tall tree", "my sister"]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")
    argv = [export, "--prompt-file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "4",
            "--cache", "shared"]
    assert generate_main(argv) == 0
    got = capsys.readouterr().out.splitlines()
    assert len(got) == 3
    for i, line in enumerate(lines):
        want = expected_text(export, line, max_new_tokens=4, cache="shared")
        assert got[i] == f"[{i + 1}] {want}"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "  "], "--prompt: the prompt is empty"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p: must lie in (0, 1], got 0.0"),
    (["--prompt", "x", "--depth", "0"], "--depth: must be >= 1, got 0"),
    (["--prompt", "x", "--exit", "fast:1"], "--exit: exit rule 'fast:1': unknown kind 'fast'"),
    (["--prompt", "x", "--speculative", "1,x"], "--speculative: expected "
     "DRAFT_DEPTH[,K|,auto[:MAX]]; K must be a positive integer, auto or auto:MAX (MAX a positive "
     "integer), got 'x' in '1,x'"),
    (["--prompt", "x", "--speculative", "1,auto:0"], "K must be a positive integer, auto or "
     "auto:MAX (MAX a positive integer), got 'auto:0' in '1,auto:0'"),
    (["--prompt", "x", "--speculative", "x,auto"], "--speculative: expected "
     "DRAFT_DEPTH[,K|,auto[:MAX]]; DRAFT_DEPTH must be a positive integer, got 'x' in 'x,auto'"),
    (["--prompt", "x", "--speculative", "2"], "--speculative: the draft depth must lie in 1..1 "
                                              "(below the depth 2), got 2"),
    (["--prompt", "x", "--speculative", "1", "--cache", "shared"],
     "--speculative: runs with the exact cache at a fixed depth; drop --exit and --cache"),
])
def test_scse_generate_bad_input_is_one_line(export, capsys, argv, message) -> None:
    assert generate_main([export, *argv]) == 65
    err = capsys.readouterr().err
    assert err.startswith("scse-generate: error: ") and message in err and err.count("\n") == 1


def test_scse_generate_reports_the_steps_an_exit_rule_used(export, capsys) -> None:
    argv = [export, "--prompt", "the cat sees", "--max-new-tokens", "5", "--depth", "6",
            "--exit", "motion:0.5,min=2"]
    assert generate_main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the cat sees")
    assert "scse-generate: exit motion:0.5,min=2: mean loop steps per token " in err
    mean = float(err.split("per token ")[1].split()[0])
    assert 2 <= mean <= 6


def first_token_with_a_space(export: str, prompt: str) -> int:
    """A seed whose first sampled token starts with '▁' (a word after the prompt's last)."""
    from scse_dist.checkpoint.export import load_exported_model
    from scse_dist.data.tokenizer import Tokenizer

    model, cfg = load_exported_model(export)
    tok = Tokenizer.load(cfg.data.tokenizer)
    for seed in range(50):
        out = generate(model, [tok.encode(prompt)], max_new_tokens=1,
                       sampling=Sampling(1.0, 1.0, seed))
        alone = tok.decode(out.tokens[0])  # sentencepiece drops a leading space here
        if alone and not alone.startswith(" ") and \
                continuation_text(tok, tok.encode(prompt), out.tokens[0]).startswith(" "):
            return seed
    raise AssertionError("no seed in 0..49 gives a first token with a leading space")


def test_the_continuation_keeps_its_leading_space(export, capsys) -> None:
    """'...functions for' + '▁the' prints '...functions for the', not '...functions forthe'
    (the continuation decoded alone drops the space of its first piece)."""
    seed = first_token_with_a_space(export, "the cat sees")
    argv = [export, "--prompt", "the cat sees", "--max-new-tokens", "5", "--temperature", "1",
            "--seed", str(seed)]
    assert generate_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat sees ") and not out.startswith("the cat sees  ")
    assert out == expected_text(export, "the cat sees", max_new_tokens=5,
                                sampling=Sampling(1.0, 1.0, seed)) + "\n"


def test_exit_without_depth_caps_at_8x_the_models_depth(export, capsys) -> None:
    """The tiny model's depth is 2: motion:0 never fires, so every token runs the cap, 16."""
    argv = [export, "--prompt", "the cat sees", "--max-new-tokens", "3", "--exit", "motion:0"]
    assert generate_main(argv) == 0
    err = capsys.readouterr().err
    assert "scse-generate: exit motion:0,max=16: mean loop steps per token 16.00 (min 16, max 16)" \
        in err
    assert generate_main(argv + ["--depth", "3"]) == 0  # --depth is the cap when given
    assert "exit motion:0: mean loop steps per token 3.00" in capsys.readouterr().err


def test_scse_generate_speculative_prints_the_same_text(export, capsys) -> None:
    argv = [export, "--prompt", "the cat sees", "--max-new-tokens", "12", "--depth", "4"]
    assert generate_main(argv) == 0
    plain = capsys.readouterr().out
    assert generate_main(argv + ["--speculative", "2,3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    line = err.strip().splitlines()[-1]
    assert line.startswith("scse-generate: speculative 2,3: ") and " drafted tokens accepted, " \
        in line and line.endswith(" tokens/s")
    assert generate_main(argv + ["--speculative", "2,auto:6"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    line = err.strip().splitlines()[-1]
    assert line.startswith("scse-generate: speculative 2,auto:6: ")
    mean_k = float(line.split("mean K ")[1].split(",")[0])
    assert 0 < mean_k <= 6
