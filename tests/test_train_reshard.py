"""Resume at another world size and worker count, with real processes: 2 ranks x 1 worker ->
1 rank x 2 workers -> 2 ranks x 0 workers, at ZeRO-1 and ZeRO-3, with sampled T, at one global
batch (train.batch.global_batch_tokens) whose accumulation each world size derives.

One epoch of a dedicated small corpus spans the three segments. The readers' own logs
(SCSE_LOG_SAMPLES: each sample whose first token was in a batch a rank consumed) name every
sample of epoch 0 exactly once; the loss continues across each change; and the optimizer state
(fp32 weights, exp_avg, exp_avg_sq of every parameter) that the 1-rank run loads through the
universal checkpoint equals the one the 2 ranks that saved it load, to fp32 tolerance.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import tiny_documents
from train_procs import all_passed, read_metrics, run_ranks, train_ranks

PROBE = str(Path(__file__).with_name("resume_probe.py"))
SEGMENTS = [(2, 1, 8), (1, 2, 16), (2, 0, 40)]  # (ranks, data.num_workers, train.max_steps)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, tiny_data):
    """20 documents (~3400 tokens) in 128-token samples: one epoch is ~25 steps of 4 x 33 tokens."""
    from scse_dist.data.shards import write_shards
    from scse_dist.data.tokenizer import Tokenizer

    out = str(tmp_path_factory.mktemp("small") / "shards")
    write_shards(tiny_documents(20, seed=3), Tokenizer.load(tiny_data["tokenizer"]), out,
                 sample_tokens=128)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_across_world_sizes_reads_the_epoch_once_and_keeps_the_optimizer_state(
        tmp_path, tiny_config, subprocess_env, small_corpus, stage):
    log = tmp_path / "samples"
    cfg = tiny_config(tmp_path, f"data.path={small_corpus}", f"train.engine.zero_stage={stage}",
                      "train.batch.micro_batch_size=2",
                      "train.batch.global_batch_tokens=128",  # 4 x 32
                      "train.log_every=1",
                      "train.checkpoint.every=1000", "train.checkpoint.keep=3")
    run_dir = tmp_path / "runs" / "tiny"
    env = dict(subprocess_env, SCSE_LOG_SAMPLES=str(log))
    for i, (world, workers, steps) in enumerate(SEGMENTS):
        if i == 1:  # the optimizer state as the 2 ranks that saved it load it
            all_passed(run_ranks([PROBE, cfg, str(tmp_path / "before.pt"), "step-0000008"],
                                 subprocess_env, world=2))
        out = all_passed(train_ranks(cfg, env, f"data.num_workers={workers}",
                                     f"train.max_steps={steps}", world=world))
        # the same global batch at every world size: the accumulation takes up the change
        assert f"global batch 4 seq (128 tokens) = micro 2 x accum {2 // world} x world {world}" \
            in out, out[-2000:]
        if i == 1:
            assert "saved by 2 ranks, resumed by 1" in out, out[-2000:]
            assert (run_dir / "checkpoints" / "step-0000008" / "universal").is_dir()
            probe = run_ranks([PROBE, cfg, str(tmp_path / "after.pt"), "step-0000008"],
                              subprocess_env, world=1)
            all_passed(probe)
    before, after = torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt")
    assert before.keys() == after.keys() and len(before) > 10
    print(f"ZeRO-{stage}: optimizer state after conversion vs before, max |diff| "
          f"{max((after[k] - v).abs().max().item() for k, v in before.items()):.2e}")
    for key, want in before.items():
        assert torch.allclose(after[key], want, rtol=0, atol=1e-6), key

    # ZeRO-1 names it mp_rank_00_model_states.pt, ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
    model_states = sorted((run_dir / "checkpoints" / "step-0000040").glob("*model_states.pt"))[0]
    state = torch.load(model_states, weights_only=False)
    assert min(r["epoch"] for rank in state["ranks"] for r in rank["data"]["readers"]) >= 1
    logged = [json.loads(line) for f in log.iterdir() for line in f.read_text().splitlines()]
    assert {tuple(x["layout"]) for x in logged} == {(2, 1), (1, 2), (2, 0)}
    epoch0 = Counter(tuple(x["item"]) for x in logged if x["epoch"] == 0)
    index = json.loads((Path(small_corpus) / "index.json").read_text())
    units = {(s, j, -1) for s, shard in enumerate(index["splits"]["train"])
             for j in range(shard["samples"])}
    print(f"ZeRO-{stage}: {len(units)} samples in epoch 0, {sum(epoch0.values())} logged starts, "
          f"per layout {Counter(tuple(x['layout']) for x in logged if x['epoch'] == 0)}")
    assert set(epoch0) == units and set(epoch0.values()) == {1}

    rows = {r["step"]: r for r in read_metrics(run_dir)}
    losses = {step: r["loss"] for step, r in rows.items()}
    print(f"ZeRO-{stage} losses:", [round(losses[s], 3) for s in sorted(losses)])
    assert sorted(losses) == list(range(1, 41))
    assert [rows[s]["tokens"] for s in range(1, 41)] == [128 * s for s in range(1, 41)]
    assert losses[40] < losses[1] - 0.5
    for cut in (8, 16):  # no jump at a change: nearer the loss before it than a fresh start's
        assert abs(losses[cut + 1] - losses[cut]) < 0.5 * (losses[1] - losses[cut]), losses
    # the LR schedule continues at the saved step (no warmup again after a cut): each segment's
    # LR is its own config's cosine (warmup 2, over its max_steps) at the step, as every resume's
    from scse_dist.config import load_config
    from scse_dist.train.schedule import LRSchedule

    train = load_config(cfg).train
    horizon = [next(m for _, _, m in SEGMENTS if s <= m) for s in range(1, 41)]
    assert [rows[s]["lr"] for s in range(1, 41)] == [
        train.optimizer.lr * LRSchedule.from_config(dataclasses.replace(train, max_steps=m))(s - 1)
        for s, m in zip(range(1, 41), horizon)]


@pytest.mark.parametrize("train, staged", [
    ({"optimizer": {"kind": "muon"}}, True), ({"optimizer": {"kind": "torch_adamw"}}, False),
    ({"optimizer": "muon"}, True), ({"optimizer": "torch_adamw"}, False), ({}, False)])
def test_a_muon_tag_is_staged_whichever_names_its_config_uses(tmp_path, train, staged):
    """A resume at another world size drops Muon's momentum (_muon_staged) for a tag whose
    config.json says train.optimizer.kind: muon, or, saved before the train sections,
    train.optimizer: muon."""
    from scse_dist.checkpoint.reshard import _muon_staged

    source = tmp_path / "step-0000006"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"train": train}))
    got = _muon_staged(source, tmp_path / "staged")
    assert (got == tmp_path / "staged") if staged else got is None
    if staged:
        assert (got / "config.json").resolve() == (source / "config.json").resolve()
