"""scse-convert retrofit: a looped model from an untied export by a layer map; at depth 1 it
computes what the untied model's kept layers compute (docs/retrofit.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY_VOCAB, tiny_config_dict
from scse_dist.checkpoint.export import save_exported_model
from scse_dist.checkpoint.loading import load_model
from scse_dist.config import config_from_dict
from scse_dist.convert.cli import main
from scse_dist.convert.retrofit import RECORD_NAME
from scse_dist.model import LoopedLM

REPO = Path(__file__).resolve().parents[1]


def untied_export(root: Path, tokenizer: str, **model) -> Path:
    """An 8-layer untied model (1 prelude, 6 core groups, 1 coda), random, its norms' gains
    perturbed so that no layer is close to another, exported."""
    fields = {"vocab_size": TINY_VOCAB, "d_model": 32, "n_heads": 2, "ffn_hidden": 64,
              "max_seq_len": 32, "recurrence": "untied", "n_prelude": 1, "n_core": 1,
              "n_coda": 1, "depth": 6, "residual": "preln", "tie_embeddings": False, **model}
    cfg = config_from_dict({"name": "source", "model": fields,
                            "data": {"seq_len": 16, "tokenizer": tokenizer}})
    torch.manual_seed(0)
    net = LoopedLM(cfg.model)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return Path(save_exported_model(net.state_dict(), cfg, str(root / "untied"),
                                    tokenizer=tokenizer))


def reference_logits(export: Path, kept: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """The untied model with the other layers removed: its own blocks in order, final norm, head."""
    net, _ = load_model(export)
    blocks = [*net.prelude, *net.core.blocks, *net.coda]
    with torch.no_grad():
        h = net.embed(tokens)
        for i in kept:
            h = blocks[i](h)
        return torch.nn.functional.linear(net.norm(h), net.head_weight)


def parse_core(flags: tuple[str, ...]) -> range:
    first, _, last = flags[flags.index("--core") + 1].partition("-")
    return range(int(first), int(last or first) + 1)


def retrofit(capsys, export: Path, out: Path, recurrence: str, *flags: str) -> tuple[int, str, str]:
    rc = main(["retrofit", str(export), "--out", str(out), "--recurrence", recurrence, *flags])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("retrofit")
    return {name: untied_export(root / name, tiny_data["tokenizer"], **model) for name, model in
            {"preln": {}, "deeploop": {"residual": "deeploop"},
             "deepnorm_forward": {"residual": "deepnorm", "branch_scale": "forward"}}.items()}


TOKENS = torch.randint(0, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
MAPS = [(("--prelude", "0", "--core", "3-5", "--coda", "7"), [0, 3, 4, 5, 7]),
        (("--prelude", "none", "--core", "2", "--coda", "4-7"), [2, 4, 5, 6, 7]),
        (("--prelude", "0-2", "--core", "3-6", "--coda", "none"), [0, 1, 2, 3, 4, 5, 6])]


@pytest.mark.parametrize("recurrence", ["looped", "additive", "scse"])
@pytest.mark.parametrize("flags, kept", MAPS)
def test_depth_one_is_the_untied_model_without_the_left_out_layers(
        exports, tmp_path, capsys, recurrence, flags, kept):
    out = tmp_path / "looped"
    rc, stdout, _ = retrofit(capsys, exports["preln"], out, recurrence, *flags)
    assert rc == 0
    assert "depth 1 computes the kept layers exactly" in stdout
    net, cfg = load_model(out)
    assert (cfg.model.recurrence, cfg.model.n_core) == (recurrence, len(parse_core(flags)))
    with torch.no_grad():
        got = net(TOKENS, depth=1).logits
        deeper = net(TOKENS, depth=2).logits
    want = reference_logits(exports["preln"], kept, TOKENS)
    assert (got - want).abs().max().item() <= 1e-5
    # the loop does something beyond depth 1: the identity is not a dead loop
    assert (deeper - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("recurrence", ["looped", "additive", "scse"])
@pytest.mark.parametrize("source", ["deeploop", "deepnorm_forward"])
def test_post_ln_depth_one_holds_up_to_the_norm_eps(exports, tmp_path, capsys, recurrence, source):
    """The new depth changes alpha (and beta): retrofit folds the ratio into the blocks."""
    out = tmp_path / "looped"
    rc, stdout, _ = retrofit(capsys, exports[source], out, recurrence, *MAPS[0][0])
    assert rc == 0 and "up to RMSNorm's eps" in stdout
    net, _ = load_model(out)
    assert net.core.blocks[0].alpha != load_model(exports[source])[0].core.blocks[0].alpha
    with torch.no_grad():
        got = net(TOKENS, depth=1).logits
    want = reference_logits(exports[source], MAPS[0][1], TOKENS)
    assert (got - want).abs().max().item() <= 1e-5


def test_the_output_and_the_record_list_the_left_out_layers(exports, tmp_path, capsys):
    out = tmp_path / "looped"
    rc, stdout, _ = retrofit(capsys, exports["preln"], out, "scse", *MAPS[0][0])
    assert rc == 0
    lines = stdout.splitlines()
    assert lines[0] == (f"scse-convert retrofit: {exports['preln']} -> {out} (scse: prelude 0, "
                        "core 3-5 (looped as one block), coda 7)")
    assert lines[1] == "layers left out: 1, 2, 6"
    record = json.loads((out / RECORD_NAME).read_text())
    assert (record["prelude"], record["core"], record["coda"], record["left_out"]) == \
        ([0], [3, 4, 5], [7], [1, 2, 6])
    model = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert (model["n_prelude"], model["n_core"], model["n_coda"], model["anchor"],
            model["init_state"]) == (1, 3, 1, "learned", "source")
    assert (out / "tokenizer.model").is_file()


def test_the_default_map_scales_the_tinyllama_map(exports, tmp_path, capsys):
    out = tmp_path / "looped"
    rc, stdout, _ = retrofit(capsys, exports["preln"], out, "additive")
    assert rc == 0 and "layers left out: 1, 2, 3" in stdout
    record = json.loads((out / RECORD_NAME).read_text())
    assert (record["prelude"], record["core"], record["coda"]) == ([0], [4, 5, 6], [7])


@pytest.mark.parametrize("flags, message", [
    (("--prelude", "0", "--core", "3-8", "--coda", "none"),
     "--core 3-8: layer 8 is past the last layer (the export has 8 layers, 0-7)"),
    (("--prelude", "0-3", "--core", "3-5", "--coda", "7"),
     "--prelude 0-3 and --core 3-5 overlap at layer 3; each layer goes to one part at most"),
    (("--prelude", "0", "--core", "none", "--coda", "7"),
     "--core: the core needs at least one layer (the loop runs it); got none"),
    (("--prelude", "0", "--core", "5-3", "--coda", "7"),
     "--core 5-3: the range runs backwards; write the lower layer first (3-5)"),
    (("--prelude", "4", "--core", "1-2", "--coda", "7"),
     "--core 1-2 comes before --prelude 4; the map runs prelude, core, coda in layer order"),
    (("--prelude", "0", "--core", "x", "--coda", "7"),
     "--core: expected a layer range A-B, one layer A, or none; got 'x'"),
    (("--core", "2-3",),
     "--prelude, --core, --coda: give all three (none for an empty part) or none of them (the "
     "default map)"),
])
def test_a_bad_map_is_one_line_exit_2_and_nothing_written(exports, tmp_path, capsys, flags,
                                                          message):
    out = tmp_path / "looped"
    rc, stdout, stderr = retrofit(capsys, exports["preln"], out, "scse", *flags)
    assert (rc, stdout, stderr) == (2, "", f"scse-convert: config error: {message}\n")
    assert list(tmp_path.iterdir()) == []


def test_a_looped_export_is_refused_and_a_foreign_out_is_kept(exports, tmp_path, capsys):
    looped = tmp_path / "looped"
    assert retrofit(capsys, exports["preln"], looped, "scse", *MAPS[0][0])[0] == 0
    rc, _, stderr = retrofit(capsys, looped, tmp_path / "again", "scse", *MAPS[0][0])
    assert rc == 65 and stderr == (f"scse-convert: error: {str(looped)!r} holds a recurrence=scse "
                                   "model; retrofit reads an untied export (model.recurrence: "
                                   "untied)\n")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors.bak").write_text("mine")
    (foreign / "config.yaml").write_text("mine")
    rc, _, stderr = retrofit(capsys, exports["preln"], foreign, "looped", *MAPS[0][0])
    assert rc == 66 and stderr.count("\n") == 1 and "this stack did not write it" in stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["config.yaml", "model.safetensors.bak"]
    assert (foreign / "config.yaml").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "looped"]


@pytest.mark.slow
def test_a_retrofitted_export_trains_from_init_from_and_evaluates_at_several_depths(
        exports, tmp_path, capsys, tiny_data, subprocess_env):
    out = tmp_path / "looped"
    assert retrofit(capsys, exports["preln"], out, "scse", *MAPS[0][0])[0] == 0
    values = tiny_config_dict(tiny_data, str(tmp_path / "runs"))
    values["model"] = yaml.safe_load((out / "config.yaml").read_text())["model"]
    values["train"].update(max_steps=3, checkpoint={"every": 3, "keep": 1})
    values["train"]["start"] = {"init_from": str(out)}
    config = tmp_path / "warm.yaml"
    config.write_text(yaml.safe_dump(values, sort_keys=False))
    run = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config",
                          str(config)], env=subprocess_env, cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"warm start from {out}: weights only" in run.stdout
    trained, _ = load_model(tmp_path / "runs" / "tiny" / "export")
    start, _ = load_model(out)
    assert not torch.equal(trained.core.anchor.weight, start.core.anchor.weight)
    targets = TOKENS.roll(-1, dims=1)
    with torch.no_grad():
        losses = trained(TOKENS, targets, readout_depths=[1, 2, 4]).loss_by_depth
    assert sorted(losses) == [1, 2, 4] and all(torch.isfinite(v) for v in losses.values())


def test_scse_starts_as_the_looped_model_and_an_orthogonal_anchor_adds_its_term(
        exports, tmp_path, capsys):
    """What docs/retrofit.md says of SCSE: with h* = 0 it is the looped model at every depth;
    with another anchor, depth 1 is the kept layers plus h* - Phi(h*)."""
    for recurrence in ("scse", "looped"):
        assert retrofit(capsys, exports["preln"], tmp_path / recurrence, recurrence,
                        *MAPS[0][0])[0] == 0
    scse, looped = load_model(tmp_path / "scse")[0], load_model(tmp_path / "looped")[0]
    with torch.no_grad():
        for depth in (1, 3):
            gap = scse(TOKENS, depth=depth).logits - looped(TOKENS, depth=depth).logits
            assert gap.abs().max().item() <= 1e-5
        torch.nn.init.orthogonal_(scse.core.anchor.weight)
        s = scse.source(TOKENS)
        anchor = scse.core.anchor(s)
        h1 = scse.core.phi(s, s) + (anchor - scse.core.phi(anchor, s))
        got = scse(TOKENS, depth=1).logits
        assert (got - scse.readout(h1)).abs().max().item() <= 1e-5
        assert (got - reference_logits(exports["preln"], MAPS[0][1], TOKENS)).abs().max() > 1e-2


def test_the_default_map_of_22_layers_is_the_papers_and_untied_match_params_numbers_its_core(
        tmp_path, capsys, tiny_data):
    from scse_dist.convert.layer_map import default_map

    assert default_map(22).record() == {"prelude": [0, 1, 2, 3], "core": list(range(10, 18)),
                                        "coda": [18, 19, 20, 21], "left_out": [4, 5, 6, 7, 8, 9]}
    # untied_match=params: one core group, so the stack is n_prelude + n_core + n_coda layers
    export = untied_export(tmp_path, tiny_data["tokenizer"], untied_match="params", n_core=3,
                           depth=2)
    rc, stdout, _ = retrofit(capsys, export, tmp_path / "looped", "looped", "--prelude", "0",
                             "--core", "2-3", "--coda", "4", "--depth", "3")
    assert rc == 0 and "layers left out: 1\n" in stdout
    net, cfg = load_model(tmp_path / "looped")
    assert (cfg.model.n_core, cfg.model.depth) == (2, 3)
    with torch.no_grad():
        got = net(TOKENS, depth=1).logits
    assert (got - reference_logits(export, [0, 2, 3, 4], TOKENS)).abs().max().item() <= 1e-5
