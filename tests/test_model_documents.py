"""model.document_mask (scse_dist/model/documents.py): in a row that packs documents, each
document gets, at every loop depth, the logits it gets alone; with the field off nothing changes;
the trainer, the held-out evaluation and KV-cache generation use it as documented."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from scse_dist.eval.perplexity import evaluate_heldout
from scse_dist.model import KVCache, LoopedLM
from scse_dist.model.blocks import Block
from scse_dist.model.config import ModelConfig
from scse_dist.model.documents import (
    BACKEND_ENV,
    FlexMask,
    backend_for,
    document_ids,
    document_mask,
    flex_attention,
    sdpa_document_mask,
)
from scse_dist.train.step import train_step
from test_train_step import RecordingEngine
from train_procs import read_metrics, run_trainer

EOS = 2
needs_flex = pytest.mark.skipif(flex_attention is None, reason="torch without FlexAttention")
KINDS = [dict(recurrence="scse"), dict(recurrence="looped"), dict(recurrence="additive"),
         dict(recurrence="scse", inject="concat", residual="preln", qk_norm=True)]


def tiny(depth: int = 2, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=64, n_prelude=1,
                       n_core=2, n_coda=1, depth=depth, document_mask=True, **kw)


def words(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(3, 64, (n,), generator=gen)  # never eos


def packed_row(gen: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A row as the loader packs it: the tail of a document begun earlier, then two whole
    documents and the head of a fourth, each opened by eos. Returns (row, its documents)."""
    docs = [words(7, gen), torch.cat([torch.tensor([EOS]), words(11, gen)]),
            torch.cat([torch.tensor([EOS]), words(5, gen)]),
            torch.cat([torch.tensor([EOS]), words(4, gen)])]
    return torch.cat(docs), docs


def test_document_ids_open_a_document_at_each_eos() -> None:
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]
    mask = sdpa_document_mask(document_ids(tokens, EOS))
    assert mask.shape == (2, 1, 7, 7)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False, False]
    assert torch.equal(mask[1, 0], torch.ones(7, 7, dtype=torch.bool).tril())  # one document


@pytest.mark.parametrize("kw", KINDS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_each_packed_document_gets_its_logits_alone_at_every_depth(kw: dict) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(**kw)).eval()
    gen = torch.Generator().manual_seed(1)
    rows = [packed_row(gen) for _ in range(2)]
    tokens = torch.stack([r for r, _ in rows])
    with torch.no_grad():
        out = model(tokens, readout_depths=[1, 2, 4], document_ids=document_ids(tokens, EOS))
        causal = model(tokens, readout_depths=[1, 2, 4])
        for b, (_, docs) in enumerate(rows):
            start = 0
            for doc in docs:
                alone = model(doc[None], readout_depths=[1, 2, 4])
                for t in (1, 2, 4):
                    got = out.logits_by_depth[t][b, start:start + len(doc)]
                    torch.testing.assert_close(got, alone.logits_by_depth[t][0], rtol=0,
                                               atol=1e-5)
                start += len(doc)
    # the later documents do see their predecessors under the causal mask: the test can fail
    assert (causal.logits_by_depth[4] - out.logits_by_depth[4])[:, 7:].abs().max() > 1e-3
    torch.testing.assert_close(causal.logits_by_depth[4][:, :7], out.logits_by_depth[4][:, :7],
                               rtol=0, atol=1e-5)


@needs_flex
def test_flex_backend_equals_the_sdpa_mask(monkeypatch) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(depth=3)).eval()
    gen = torch.Generator().manual_seed(2)
    tokens = torch.stack([packed_row(gen)[0] for _ in range(3)])
    docs = document_ids(tokens, EOS)
    with torch.no_grad():
        sdpa = model(tokens, document_ids=docs).logits
        monkeypatch.setenv(BACKEND_ENV, "flex")
        assert isinstance(document_mask(docs), FlexMask)
        with warnings.catch_warnings():  # flex on CPU runs unfused, and says so
            warnings.simplefilter("ignore")
            flex = model(tokens, document_ids=docs).logits
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


@needs_flex
def test_backend_choice_by_device_and_override(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(torch.device("cpu")) == "sdpa"
    assert backend_for(torch.device("cuda")) == "flex"
    monkeypatch.setenv(BACKEND_ENV, "sdpa")
    assert backend_for(torch.device("cuda")) == "sdpa"
    monkeypatch.setenv(BACKEND_ENV, "varlen")
    with pytest.raises(ValueError, match="SCSE_DOCMASK_BACKEND: expected one of sdpa, flex"):
        backend_for(torch.device("cpu"))


def test_field_off_changes_nothing() -> None:
    """Same weights either way; off, the model gives no document ids, so the trainer's and the
    evaluation's forwards are today's causal ones, bit for bit."""
    on = tiny()
    off = dataclasses.replace(on, document_mask=False)
    torch.manual_seed(0)
    model_on = LoopedLM(on)
    torch.manual_seed(0)
    model_off = LoopedLM(off)
    assert all(torch.equal(a, b) for a, b in zip(model_on.state_dict().values(),
                                                 model_off.state_dict().values()))
    tokens = torch.stack([packed_row(torch.Generator().manual_seed(3))[0]])
    assert model_off.documents(tokens, EOS) is None
    assert torch.equal(model_on.documents(tokens, EOS), document_ids(tokens, EOS))
    with torch.no_grad():
        plain = model_off(tokens, depth=3).logits
        passed = model_off(tokens, depth=3, document_ids=model_off.documents(tokens, EOS)).logits
    assert torch.equal(plain, passed)
    batches = [torch.stack([packed_row(torch.Generator().manual_seed(s))[0] for s in (4, 5)])]
    assert evaluate_heldout(model_off, batches, [1, 3], eos_id=EOS) == \
        evaluate_heldout(model_off, batches, [1, 3])


def test_heldout_evaluation_scores_a_masked_model_as_it_trains() -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny())
    batches = [torch.stack([packed_row(torch.Generator().manual_seed(s))[0] for s in (6, 7)])]
    rows = evaluate_heldout(model, batches, [1, 2], eos_id=EOS)
    inputs, targets = batches[0][:, :-1], batches[0][:, 1:]
    with torch.no_grad():
        want = model(inputs, targets, readout_depths=[1, 2], keep_logits=False,
                     document_ids=document_ids(inputs, EOS)).loss_by_depth
    for row in rows:
        assert row["loss"] == pytest.approx(float(want[row["depth"]]), rel=1e-5)
    causal = evaluate_heldout(model, batches, [1, 2])
    assert abs(causal[1]["loss"] - rows[1]["loss"]) > 1e-4


def test_kv_cache_generation_matches_the_masked_forward_on_one_document() -> None:
    """A prompt is one document: decoding with the cache (no document ids) gives the logits the
    document-masked forward gives it, token by token."""
    torch.manual_seed(0)
    model = LoopedLM(tiny(depth=3)).eval()
    doc = torch.cat([torch.tensor([EOS]), words(9, torch.Generator().manual_seed(8))])[None]
    with torch.no_grad():
        full = model(doc, depth=3, document_ids=document_ids(doc, EOS)).logits
        cache = KVCache()
        steps = [model.decode_step(doc[:, :5], cache, depth=3).logits]
        steps += [model.decode_step(doc[:, i:i + 1], cache, depth=3).logits
                  for i in range(5, doc.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_train_step_masks_each_window_by_its_eos() -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny())
    gen = torch.Generator().manual_seed(9)
    windows = [torch.stack([packed_row(gen)[0] for _ in range(2)]) for _ in range(2)]
    result = train_step(RecordingEngine(model), windows, depth=2, eos_id=EOS)
    with torch.no_grad():
        want = sum(float(model(w[:, :-1], w[:, 1:], depth=2, keep_logits=False,
                               document_ids=document_ids(w[:, :-1], EOS)).loss) for w in windows)
        causal = sum(float(model(w[:, :-1], w[:, 1:], depth=2, keep_logits=False).loss)
                     for w in windows)
    assert float(result.loss_sum) == pytest.approx(want, rel=1e-6)
    assert abs(want - causal) > 1e-4


def test_document_ids_with_padding_is_refused() -> None:
    model = LoopedLM(tiny())
    tokens = torch.tensor([[3, 4, EOS, 5]])
    with pytest.raises(ValueError, match="document_ids: not with attention_mask"):
        model(tokens, attention_mask=torch.ones_like(tokens),
              document_ids=document_ids(tokens, EOS))
    with pytest.raises(ValueError, match=r"document_ids: expected the tokens' shape \(1, 4\)"):
        model(tokens, document_ids=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.slow
def test_training_with_the_document_mask_runs_end_to_end(tmp_path, tiny_config, tiny_data,
                                                         subprocess_env) -> None:
    """The trainer on the tiny shards (eos before every document): the loss falls, the held-out
    rows come, the saved config keeps the field."""
    from itertools import islice

    from scse_dist.data.stream import TokenStream

    batches = islice(TokenStream(tiny_data["path"], seq_len=32, batch_size=4, seed=0), 12)
    assert sum(int((b == EOS).sum()) for b in batches) >= 3  # documents meet in the windows
    cfg = tiny_config(tmp_path, "model.document_mask=true", "train.max_steps=12",
                      "eval.every_steps=6", "train.checkpoint.every=12")
    out = run_trainer(cfg, subprocess_env)
    rows = read_metrics(tmp_path / "runs" / "tiny")
    losses = [r["loss"] for r in rows if "kind" not in r]
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert losses[-1] < losses[0] and len(evals) == 2
    assert all(r["heldout_loss_T2"] == r["heldout_loss_T2"] for r in evals)  # finite, not NaN
    saved = (tmp_path / "runs" / "tiny" / "config.yaml").read_text()
    assert "document_mask: true" in saved
    assert "training tiny" in out


def test_the_backend_is_logged_once_per_process(monkeypatch, capsys) -> None:
    from scse_dist.model import documents

    monkeypatch.setattr(documents, "_logged", set())
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    docs = document_ids(torch.tensor([[3, EOS, 4]]), EOS)
    document_mask(docs)
    document_mask(docs)
    assert capsys.readouterr().err == \
        "model.document_mask: attention within documents through sdpa (cpu)\n"


def test_compiled_blocks_take_the_document_mask(monkeypatch) -> None:
    """train.engine.compile: the regional compile of the blocks' math gives the eager masked
    logits."""
    monkeypatch.setenv("SCSE_COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = LoopedLM(tiny()).eval()
    tokens = torch.stack([packed_row(torch.Generator().manual_seed(10))[0]])
    docs = document_ids(tokens, EOS)
    with torch.no_grad():
        eager = model(tokens, depth=2, document_ids=docs).logits
        model.compile_blocks()
        compiled = model(tokens, depth=2, document_ids=docs).logits
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


@pytest.fixture
def inductor_flex(monkeypatch):
    """Flex forced, dynamo fresh: a compiled block then runs flex_attention inside inductor's
    graph, as train.engine.compile does on CUDA (flex's backward is not implemented on CPU:
    forward)."""
    monkeypatch.setenv(BACKEND_ENV, "flex")
    monkeypatch.setenv("SCSE_COMPILE_BACKEND", "inductor")
    torch._dynamo.reset()
    with warnings.catch_warnings():  # flex on CPU runs unfused, and says so
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


@pytest.mark.slow
@needs_flex
@pytest.mark.parametrize("compiled", ["block", "flex"])
def test_flex_compiled_by_inductor_equals_the_sdpa_mask(inductor_flex, compiled: str) -> None:
    """In a compiled block (train.engine.compile) and compiled alone (FlexMask.compiled: CUDA
    without train.engine.compile). v is a strided view of the qkv projection, q and k contiguous
    after RoPE: inside the block's graph inductor's flex read v wrongly (the output off by 0.13
    here) until attend made the three contiguous; compiled alone it was right either way."""
    torch.manual_seed(0)
    block = Block(tiny())
    tokens = torch.stack([packed_row(torch.Generator().manual_seed(11))[0] for _ in range(2)])
    docs = document_ids(tokens, EOS)
    h = torch.randn(*tokens.shape, 32)
    mask = document_mask(docs)
    assert isinstance(mask, FlexMask)
    with torch.no_grad():
        sdpa = block(h, mask=sdpa_document_mask(docs))
        if compiled == "block":
            block.compile_math("inductor")
        else:
            mask.compiled = True
        flex = block(h, mask=mask)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


@pytest.mark.slow
@needs_flex
def test_flex_in_inductor_compiled_blocks_gives_the_sdpa_logits(inductor_flex,
                                                               monkeypatch) -> None:
    torch.manual_seed(0)
    model = LoopedLM(tiny(depth=3)).eval()
    tokens = torch.stack([packed_row(torch.Generator().manual_seed(12))[0] for _ in range(2)])
    docs = document_ids(tokens, EOS)
    with torch.no_grad():
        monkeypatch.setenv(BACKEND_ENV, "sdpa")
        sdpa = model(tokens, document_ids=docs).logits
        monkeypatch.setenv(BACKEND_ENV, "flex")
        model.compile_blocks()
        flex = model(tokens, document_ids=docs).logits
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
