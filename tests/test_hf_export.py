"""An export loads in Hugging Face transformers as remote code, without scse-dist, and gives the
native model's numbers (a scse, an additive, a model.qk_norm + branch_scale=forward export
(whose gain-1 weights are wrong by 1/beta without the field) and a grouped-query one
(n_kv_heads 4:1, a head_dim not d_model / n_heads); one whose config.json
predates qk_norm loads with it off): logits at depths 1, 4, 32 (fp32, 1e-5), a left-padded batch
equal to each sequence alone, the tokenizer's ids and text equal to scse-dist's, greedy generation
equal to the native model's recomputed greedy at num_steps 1 and 8, batched and alone, both through
the model's KV cache (generate's default) and without it (use_cache=False); and what save_pretrained
writes loads back the same. With the cache, a core block runs T (+1 for scse) single-token calls per
new token after the prefill (a forward hook counts them); a foreign cache is refused; a bf16 load
generates.

The transformers side runs in a subprocess whose cwd is a temp dir, with scse_dist blocked from
import and the export copied to a new place. It runs with the installed transformers (CI: 5.x)
and, when $SCSE_TF457_PATH names a dir holding transformers 4.57 (`pip install --no-deps --target
DIR transformers==4.57.1 tokenizers==0.22.1 huggingface_hub==0.36.0`), with that one first on
the path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY_VOCAB, WITHOUT_SCSE_DIST
from scse_dist.checkpoint.export import load_exported_model, save_exported_model
from scse_dist.config import config_from_dict
from scse_dist.data.tokenizer import Tokenizer
from scse_dist.generate import generate
from scse_dist.hf import HERE, MODEL_PACKAGE, REMOTE_CODE
from scse_dist.model import LoopedLM
from scse_dist.model.exit_rules import parse_exit_rule

DEPTHS = (1, 4, 32)
GENERATE_STEPS, NEW_TOKENS = (1, 8), 5
EXIT_RULE = "motion:0.05,max=8"  # generate's exit_rule, through the cache
TEXTS = ["the cat sees a green box today.", "  Two  spaces,\ttabs\nand lines.  ",
         "Grüße aus Köln — naïve café, 東京, emoji 😀 and </s> <unk> as text."]
PROMPTS = ["the old man", "a small bird follows the tall tree in the park. my sister"]

CHILD = WITHOUT_SCSE_DIST + r"""
import json
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
job = torch.load(sys.argv[1])
print("transformers", transformers.__version__, file=sys.stderr)
out = {"version": transformers.__version__, "exports": []}
for export in job["exports"]:
    config = AutoConfig.from_pretrained(export["dir"], trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(export["dir"], trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(export["dir"], trust_remote_code=True)
    res = {"config": {k: getattr(config, k) for k in export["fields"]}}
    with torch.no_grad():
        ids = job["tokens"]
        res["logits"] = {t: model(ids, num_steps=t).logits for t in job["depths"]}
        res["default_depth"] = model(ids).logits
        res["by_depth"] = model(ids, readout_depths=[1, 4]).logits_by_depth
        res["loss"] = model(ids, labels=ids, num_steps=4).loss
        batch = tok(job["prompts"], return_tensors="pt", padding=True)
        res["padded_ids"], res["padded_mask"] = batch.input_ids, batch.attention_mask
        res["padded_logits"] = model(**batch, num_steps=4).logits
        width = batch.input_ids.shape[1]
        core_block = model.model.core.blocks[0]  # one physical core block: its calls' lengths
        calls = []
        core_block.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
        greedy = dict(do_sample=False, max_new_tokens=job["new_tokens"])
        res["generated"], res["calls"] = {}, {}
        for steps in job["steps"]:
            for use_cache in (True, False):
                calls.clear()
                batched = model.generate(**batch, num_steps=steps, use_cache=use_cache, **greedy)
                res["calls"][steps, use_cache] = list(calls)
                alone = [model.generate(**tok([p], return_tensors="pt"), num_steps=steps,
                                        use_cache=use_cache, **greedy)[0] for p in job["prompts"]]
                res["generated"][steps, use_cache] = (batched, alone)
        # a cache handed back to generate: 2 tokens, then the rest continuing from that cache
        field = lambda step: step["cache"] if "cache" in step else step["past_key_values"]
        cache_arg = "cache" if transformers.__version__ >= "5" else "past_key_values"
        first = model.generate(**batch, num_steps=8, do_sample=False, max_new_tokens=2,
                               return_dict_in_generate=True)
        mask = torch.cat([batch.attention_mask, torch.ones_like(first.sequences[:, width:])], 1)
        res["continued"] = model.generate(first.sequences, attention_mask=mask, num_steps=8,
                                          do_sample=False, max_new_tokens=job["new_tokens"] - 2,
                                          **{cache_arg: field(first)})
        res["shared"] = model.generate(**batch, num_steps=8, cache_mode="shared", **greedy)
        res["exit"] = [model.generate(**tok([p], return_tensors="pt"), exit_rule=job["exit"],
                                      **greedy)[0] for p in job["prompts"]]
        # forward with use_cache: a prefix, then one token at a time with the returned cache
        step = model(ids[:, :20], use_cache=True, num_steps=4)
        steps_logits, cache = [step.logits], field(step)
        for i in range(20, ids.shape[1]):
            step = model(ids[:, i:i + 1], past_key_values=cache, num_steps=4)
            assert field(step) is cache
            steps_logits.append(step.logits)
        res["cached_logits"] = torch.cat(steps_logits, 1)
        res["cache_length"] = cache.get_seq_length()
        res["refused"] = []
        class FilledCache:  # something not this model's cache, with tokens in it
            def get_seq_length(self):
                return 3
        for call in (lambda: model(ids[:, -1:], past_key_values=FilledCache()),
                     lambda: model(ids[:, -1:], past_key_values=transformers.DynamicCache()),
                     lambda: model.generate(**batch, **{cache_arg: transformers.DynamicCache()},
                                            **greedy),
                     lambda: model(ids[:, -1:], past_key_values=cache, num_steps=5),
                     lambda: model.generate(**batch, cache_mode="bogus", **greedy)):
            try:
                call()
                res["refused"].append(None)
            except ValueError as exc:
                res["refused"].append(str(exc))
        # bf16 (`dtype`: 5.x, and 4.57 too, where `torch_dtype` is its deprecated name)
        bf16 = AutoModelForCausalLM.from_pretrained(export["dir"], trust_remote_code=True,
                                                    dtype=torch.bfloat16).eval()
        res["bf16_dtype"] = str(next(bf16.parameters()).dtype)
        res["bf16_logits"] = bf16(**batch, num_steps=8).logits.float()
        res["bf16_generated"] = bf16.generate(**batch, num_steps=8, **greedy)
    res["encoded"] = [tok(t, add_special_tokens=False).input_ids for t in job["texts"]]
    res["encoded_special"] = [tok(t).input_ids for t in job["texts"]]
    res["decoded"] = [tok.decode(i) for i in res["encoded"]]
    res["decoded_skip"] = [tok.decode(i, skip_special_tokens=True) for i in res["encoded_special"]]
    # save_pretrained writes transformers' own layout (`model.`-prefixed names); it loads back
    model.save_pretrained(export["dir"] + "-resaved")
    tok.save_pretrained(export["dir"] + "-resaved")
    again = AutoModelForCausalLM.from_pretrained(export["dir"] + "-resaved", trust_remote_code=True)
    tok_again = AutoTokenizer.from_pretrained(export["dir"] + "-resaved", trust_remote_code=True)
    with torch.no_grad():
        res["resaved_equal"] = torch.equal(again(job["tokens"], num_steps=4).logits,
                                           res["logits"][4])
    res["resaved_encoded"] = [tok_again(t).input_ids for t in job["texts"]]
    out["exports"].append(res)
torch.save(out, sys.argv[2])
assert not any(m.split(".")[0] == "scse_dist" for m in sys.modules)
"""


def _relative_imports(path: Path) -> set[str]:
    """transformers' own rule (dynamic_module_utils.get_relative_imports): `from .NAME import`."""
    return set(re.findall(r"^\s*from\s+\.(\S+)\s+import", path.read_text(), flags=re.MULTILINE))


def _source(name: str) -> Path:
    return HERE / f"{name}.py" if (HERE / f"{name}.py").is_file() else MODEL_PACKAGE / f"{name}.py"


def test_remote_files_import_every_module_they_reach():
    # transformers 4.57 copies only a remote file's own relative imports into its module cache but
    # needs every module they reach; each of them must sit in the export as a flat module.
    for name in ("modeling_scse", "configuration_scse"):
        direct = _relative_imports(_source(name))
        reached, todo = set(), set(direct)
        while todo:
            module = todo.pop()
            assert _source(module).is_file(), f"{name} reaches .{module}, which is no flat module"
            reached.add(module)
            todo |= _relative_imports(_source(module)) - reached
        assert reached <= direct, f"{name}.py must import {sorted(reached - direct)} itself"


def _export(root: Path, tokenizer: str, **model) -> Path:
    cfg = config_from_dict({"name": "hf", "data": {"seq_len": 64},
                            "model": {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2,
                                      "ffn_hidden": 64, "max_seq_len": 64, "depth": 3, **model}})
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    with torch.no_grad():  # qk_norm's gains away from their init of ones: a path without one shows
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return Path(save_exported_model(model.state_dict(), cfg, str(root), tokenizer=tokenizer))


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_data) -> list[Path]:
    root = tmp_path_factory.mktemp("hf")
    return [_export(root / "scse", tiny_data["tokenizer"], n_core=2),
            _export(root / "additive", tiny_data["tokenizer"], recurrence="additive",
                    residual="preln", tie_embeddings=False),
            _export(root / "qknorm", tiny_data["tokenizer"], n_core=2, qk_norm=True,
                    branch_scale="forward"),
            _export(root / "gqa", tiny_data["tokenizer"], n_core=2, n_heads=4, n_kv_heads=1,
                    head_dim=16, qk_norm=True)]


def test_export_writes_the_remote_code_and_config(exports):
    path = exports[0]
    _, cfg = load_exported_model(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "scse" and config["auto_map"] == {
        "AutoConfig": "configuration_scse.ScseConfig",
        "AutoModelForCausalLM": "modeling_scse.ScseForCausalLM",
        "AutoTokenizer": ["tokenization_scse.ScseTokenizer", None]}
    assert {k: config[k] for k in dataclasses.asdict(cfg.model)} == dataclasses.asdict(cfg.model)
    eos = Tokenizer.load(str(path / "tokenizer.model")).eos_id
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (eos,) * 3
    for source in [HERE / n for n in REMOTE_CODE] + sorted(MODEL_PACKAGE.glob("*.py")):
        copy = path / source.name
        assert copy.is_file() != (source.name == "__init__.py"), source.name
        assert source.name == "__init__.py" or copy.read_bytes() == source.read_bytes()


def _after_eos(tokens: torch.Tensor, eos: int) -> list[int]:
    """The tokens as HF generate returns them: after a sequence's EOS, EOS (its pad) again."""
    tokens = tokens.tolist()
    return tokens[:tokens.index(eos)] + [eos] * (len(tokens) - tokens.index(eos)) \
        if eos in tokens else tokens


def _native(path: Path, tokens: torch.Tensor, tokenizer: Tokenizer) -> dict:
    """What the HF side must reproduce, from scse-dist's own model and tokenizer."""
    model, _ = load_exported_model(path)
    out: dict = {"prompt_ids": [[tokenizer.eos_id, *tokenizer.encode(p)] for p in PROMPTS]}
    with torch.no_grad():
        out["logits"] = {t: model(tokens, depth=t).logits for t in DEPTHS}
        out["default_depth"] = model(tokens).logits
        logits = model(tokens, depth=4).logits
        out["loss"] = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                        tokens[:, 1:].flatten())
        out["alone_logits"] = [model(torch.tensor([ids]), depth=4).logits[0]
                               for ids in out["prompt_ids"]]
        out["greedy"] = {}  # greedy, the whole sequence recomputed each token
        for steps in GENERATE_STEPS:
            out["greedy"][steps] = []
            for ids in out["prompt_ids"]:
                seq = torch.tensor([ids])
                for _ in range(NEW_TOKENS):
                    nxt = model(seq, depth=steps).logits[:, -1].argmax(-1, keepdim=True)
                    seq = torch.cat([seq, nxt], dim=1)
                out["greedy"][steps].append(_after_eos(seq[0, len(ids):], tokenizer.eos_id))
    rule = parse_exit_rule(EXIT_RULE)
    out["exit"] = [_after_eos(torch.tensor(generate(model, [ids], max_new_tokens=NEW_TOKENS,
                                                    exit_rule=rule).tokens[0]), tokenizer.eos_id)
                   for ids in out["prompt_ids"]]
    return out


def _transformers_variants() -> list:
    installed = pytest.param(None, id="installed", marks=pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None, reason="transformers is not installed"))
    tf457 = os.environ.get("SCSE_TF457_PATH")
    other = pytest.param(tf457, id="tf457", marks=pytest.mark.skipif(
        not tf457, reason="set SCSE_TF457_PATH to a dir holding transformers 4.57 (see docstring)"))
    return [installed, other]


@pytest.mark.slow
@pytest.mark.parametrize("transformers_path", _transformers_variants())
def test_transformers_loads_the_export_without_scse_dist(exports, tiny_data, tmp_path,
                                                         transformers_path):
    tokenizer = Tokenizer.load(tiny_data["tokenizer"])
    tokens = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    copies = []
    for path in exports:  # the export copied to a new place, loaded from there
        copies.append(tmp_path / "elsewhere" / path.name)
        shutil.copytree(path, copies[-1])
    # the first as an export written before model.qk_norm existed: it loads with qk_norm off
    old_config = json.loads((copies[0] / "config.json").read_text())
    assert old_config.pop("qk_norm") is False
    (copies[0] / "config.json").write_text(json.dumps(old_config))
    job = {"exports": [{"dir": str(c), "fields": ["depth", "recurrence", "d_model", "qk_norm",
                                                 "branch_scale", "n_kv_heads", "head_dim"]}
                       for c in copies],
           "tokens": tokens, "depths": DEPTHS, "prompts": PROMPTS, "texts": TEXTS,
           "steps": GENERATE_STEPS, "new_tokens": NEW_TOKENS, "exit": EXIT_RULE}
    torch.save(job, tmp_path / "job.pt")
    (tmp_path / "cwd").mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HOME": str(tmp_path / "hf_home"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if transformers_path:
        env["PYTHONPATH"] = transformers_path
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "job.pt"),
                          str(tmp_path / "out.pt")], cwd=tmp_path / "cwd", env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    hf = torch.load(tmp_path / "out.pt")
    assert hf["version"].startswith("4.57") if transformers_path else hf["version"]
    print(f"transformers {hf['version']}")
    for path, res in zip(exports, hf["exports"]):
        native, (_, cfg) = _native(path, tokens, tokenizer), load_exported_model(path)
        assert res["config"] == {"depth": 3, "recurrence": cfg.model.recurrence, "d_model": 32,
                                 "qk_norm": cfg.model.qk_norm,
                                 "branch_scale": cfg.model.branch_scale,
                                 "n_kv_heads": cfg.model.n_kv_heads,
                                 "head_dim": cfg.model.head_dim}
        for t in DEPTHS:
            diff = (res["logits"][t] - native["logits"][t]).abs().max().item()
            print(f"{path.name} depth {t}: max |HF - native| logit = {diff:.2e}")
            assert diff <= 1e-5, (path.name, t, diff)
        assert torch.allclose(res["default_depth"], native["default_depth"], atol=1e-5, rtol=0)
        assert sorted(res["by_depth"]) == [1, 4]
        for t, logits in res["by_depth"].items():
            assert torch.allclose(logits, native["logits"][t], atol=1e-5, rtol=0)
        assert torch.allclose(res["loss"], native["loss"], atol=1e-6, rtol=0)
        # forward with the cache: a prefix, then one token per call == one forward over it all
        diff = (res["cached_logits"] - native["logits"][4]).abs().max().item()
        print(f"{path.name} cached forward, depth 4: max |cached - native| logit = {diff:.2e}")
        assert diff <= 1e-5 and res["cache_length"] == tokens.shape[1]
        foreign, dynamic, generate_dynamic, depth_change, bad_mode = res["refused"]
        assert "must be the ScseCache this model returned" in foreign
        assert "not FilledCache" in foreign and "not DynamicCache" in dynamic
        assert "not DynamicCache" in generate_dynamic
        assert "this cache holds 4 loop steps, got depth=5" in depth_change
        assert "cache mode: must be one of exact, shared; got 'bogus'" in bad_mode
        # the tokenizer: scse-dist's ids and text; a prompt starts after an EOS, as in training
        assert res["encoded"] == [tokenizer.encode(t) for t in TEXTS]
        assert res["encoded_special"] == [[tokenizer.eos_id, *tokenizer.encode(t)] for t in TEXTS]
        assert res["decoded"] == res["decoded_skip"] == TEXTS
        assert res["resaved_equal"] and res["resaved_encoded"] == res["encoded_special"]
        # left padding: each row's real tokens give the logits that sequence has alone
        width = res["padded_ids"].shape[1]
        for row, ids in enumerate(native["prompt_ids"]):
            assert res["padded_ids"][row, width - len(ids):].tolist() == ids
            assert res["padded_mask"][row].sum().item() == len(ids)
            diff = (res["padded_logits"][row, width - len(ids):] - native["alone_logits"][row])
            print(f"{path.name} padded row {row}: max logit diff = {diff.abs().max().item():.2e}")
            assert diff.abs().max().item() <= 1e-5
        # greedy generate == native greedy recomputed, batched (left-padded) and alone, with the
        # cache and without, at num_steps 1 and 8
        prefill = width
        extra = 1 if cfg.model.recurrence == "scse" else 0  # r* = Phi(h*): one more core call
        for steps in GENERATE_STEPS:
            for use_cache in (True, False):
                batched, alone = res["generated"][steps, use_cache]
                for row, (ids, want) in enumerate(zip(native["prompt_ids"],
                                                      native["greedy"][steps])):
                    assert batched[row, width:].tolist() == want, (steps, use_cache, row)
                    assert alone[row][len(ids):].tolist() == want, (steps, use_cache, row)
            # a core block's calls: with the cache, the prefill, then T (+1) one-token calls per
            # new token; without, the whole sequence again for every token
            calls, per_token = res["calls"][steps, True], steps + extra
            print(f"{path.name} T={steps}: core block calls with cache {calls}")
            assert calls == [prefill] * per_token + [1] * per_token * (NEW_TOKENS - 1)
            assert res["calls"][steps, False] == [n for i in range(NEW_TOKENS)
                                                  for n in [prefill + i] * per_token]
        assert torch.equal(res["continued"], res["generated"][8, True][0])
        # the shared cache: the prefill is exact, so the first token is too
        assert res["shared"].shape == res["generated"][8, True][0].shape
        assert res["shared"][:, width].tolist() == res["generated"][8, True][0][:, width].tolist()
        # an exit rule through the cache == scse-generate's (the native decode loop)
        for row, (ids, want) in enumerate(zip(native["prompt_ids"], native["exit"])):
            assert res["exit"][row][len(ids):].tolist() == want, row
        # bf16 loads and generates: finite logits; the first new token (a tiny random model's
        # logits are close together, so only that one) as in fp32
        assert res["bf16_dtype"] == "torch.bfloat16"
        assert torch.isfinite(res["bf16_logits"]).all()
        print(f"{path.name} bf16 generated {res['bf16_generated'][:, width:].tolist()}, fp32 "
              f"{res['generated'][8, True][0][:, width:].tolist()}")
        assert res["bf16_generated"][:, width].tolist() == \
            res["generated"][8, True][0][:, width].tolist()


@pytest.mark.slow
def test_depth_is_refused_naming_num_steps_not_run_at_the_config_depth(exports, tmp_path,
                                                                      monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        exports[0], trust_remote_code=True).eval()
    ids = torch.randint(3, TINY_VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    for call in (lambda: model(ids, depth=1), lambda: model(ids, num_step=1)):
        with pytest.raises(TypeError, match=r"\(s\) (depth|num_step); the loop depth is "
                                            "`num_steps`"):
            call()
    with pytest.raises(ValueError, match=r"not used by the model: \['depth'\]"):  # generate's
        model.generate(ids, depth=1, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # what transformers passes is still taken
        out = model(ids, num_steps=1, output_attentions=False, output_hidden_states=False,
                    cache_position=None, return_dict=True)
        assert torch.equal(out.logits, model(ids, num_steps=1).logits)
