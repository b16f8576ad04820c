"""docs/pretrained.md's recipe end to end, each step a real console script: a tiny random
LlamaForCausalLM (grouped-query 4:1, untied, llama3 RoPE scaling) and a tiny random
Qwen3ForCausalLM (q/k norm, head_dim 24, tied), saved with save_pretrained, are imported
(`scse-convert from-hf`, transformers' logits), retrofitted into SCSE (`scse-convert retrofit`,
depth 1 is still transformers' model), given shards written with their own tokenizer
(`scse-data shards`), trained 10 steps from the retrofitted export with the curriculum under
DeepSpeed ZeRO-1 and ZeRO-3 (the page's own run config, `base:` the export's config.yaml, its
sizes shrunk by overrides), evaluated at T = 1, 2, 4 by the run and by `scse-eval` (the same
numbers), and exported: transformers' AutoModelForCausalLM with remote code computes the native
model's logits.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import console_script, tiny_documents  # noqa: E402
from scse_dist.checkpoint.export import load_exported_model  # noqa: E402
from scse_dist.data.tokenizer import Tokenizer  # noqa: E402
from scse_dist.data.tokenizer_hf import train_byte_bpe  # noqa: E402
from test_convert_hf import VOCAB, llama, max_diff, qwen3, tokens  # noqa: E402

DEPTHS = [1, 2, 4]
STEPS = 10
REPO = Path(__file__).resolve().parents[1]
# The user's choices the docs' config leaves to them, made tiny (the model's are the export's).
SHRINK = (f"train.max_steps={STEPS}", "train.batch.micro_batch_size=4",
          "train.batch.global_batch_size=4", "train.schedule.warmup_steps=2", "train.log_every=1",
          f"train.checkpoint.every={STEPS}", "data.seq_len=32", "eval.depths=[1,2,4]",
          "eval.batch_size=4", "eval.max_batches=2")


def docs_config() -> str:
    """docs/pretrained.md's run config, as the page gives it."""
    text = (REPO / "docs" / "pretrained.md").read_text()
    block = re.search(r"^   ```yaml\n(.*?)^   ```", text, flags=re.S | re.M)
    assert block is not None
    return textwrap.dedent(block.group(1))


def run(env: dict, cwd: Path, name: str, *args: str) -> str:
    proc = subprocess.run([*console_script(name), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{name} {args}: {proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def losses(results: Path) -> dict[int, float]:
    return {r["depth"]: r["loss"] for r in json.loads(results.read_text())["results"]}


@pytest.mark.slow
@pytest.mark.parametrize("build", [llama, qwen3])
def test_import_retrofit_train_zero_1_and_3_evaluate_and_export(build, tmp_path, subprocess_env):
    docs = tiny_documents(300, seed=3)
    tok = Path(train_byte_bpe(docs, VOCAB, str(tmp_path / "tokenizer.json")))
    model, folder = build(tmp_path, tok)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    env = dict(subprocess_env, DS_ACCELERATOR="cpu")

    # the docs' paths, so that the docs' run config finds the export and the shards
    export, shards = "exports/smollm2-scse", "data/smollm2/shards"
    run(env, tmp_path, "scse-convert", "from-hf", str(folder), "--out", "exports/smollm2")
    assert max_diff(model, load_exported_model(tmp_path / "exports/smollm2")[0]) <= 1e-4
    out = run(env, tmp_path, "scse-convert", "retrofit", "exports/smollm2", "--out", export,
              "--recurrence", "scse", "--prelude", "0", "--core", "1", "--coda", "none")
    assert "layers left out: none" in out
    start, start_cfg = load_exported_model(tmp_path / export)
    assert (start_cfg.model.recurrence, start_cfg.model.depth) == ("scse", 4)
    with torch.no_grad():  # every layer kept: depth 1 is transformers' model
        assert (model(tokens()).logits - start(tokens(), depth=1).logits).abs().max() <= 1e-4

    run(env, tmp_path, "scse-data", "shards", "--input", "docs.jsonl", "--tokenizer",
        f"{export}/tokenizer.json", "--out", shards, "--heldout-fraction", "0.1",
        "--sample-tokens", "512")
    index = json.loads((tmp_path / shards / "index.json").read_text())
    assert index["tokenizer_sha256"] == Tokenizer.load(str(tok)).sha256
    (tmp_path / "smollm2-scse.yaml").write_text(docs_config())

    for stage in (1, 3):
        name = f"zero{stage}"
        out = run(env, tmp_path, "scse-train", "--config", "smollm2-scse.yaml", f"name={name}",
                  f"train.engine.zero_stage={stage}", *SHRINK)
        assert f"warm start from {tmp_path / export}: weights only" in out
        run_dir = tmp_path / "runs" / name
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if "depth_mean" in r]
        means = [r["depth_mean"] for r in train_rows]
        assert len(means) == STEPS and means[0] == 1.0 and means[-1] == 4.0  # the ramp, 1 -> 4
        assert means == sorted(means) and len(set(means)) >= 3
        trained, cfg = load_exported_model(run_dir / "export")
        assert cfg.train.engine.zero_stage == stage
        assert cfg.model == start_cfg.model  # the base: gave the run the export's model
        moved = max((trained.state_dict()[k] - v).abs().max().item()
                    for k, v in start.state_dict().items())
        assert 1e-4 < moved < 0.1  # trained, from the retrofitted weights
        own = losses(run_dir / "eval" / "heldout.json")
        assert sorted(own) == DEPTHS and all(v < 6.0 for v in own.values())  # ln 300 = 5.7

        remote = transformers.AutoModelForCausalLM.from_pretrained(
            run_dir / "export", trust_remote_code=True).eval()
        with torch.no_grad():
            for depth in DEPTHS:
                assert (remote(tokens(), num_steps=depth).logits
                        - trained(tokens(), depth=depth).logits).abs().max() <= 1e-4

    run(env, tmp_path, "scse-eval", "--checkpoint", "runs/zero3/export", "--task", "heldout",
        "--data", shards, "--depths", "1,2,4", "--batch-size", "4", "--max-batches", "2",
        "--seq-len", "32", "--out", "depths.json")
    evaluated = losses(tmp_path / "depths.json")
    assert sorted(evaluated) == DEPTHS
    assert all(abs(evaluated[d] - own[d]) <= 1e-5 for d in DEPTHS), (evaluated, own)
