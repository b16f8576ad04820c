"""`scse-convert retrofit`: a looped model from an untied export by a layer map (docs/retrofit.md).

    scse-convert retrofit EXPORT --out OUT --recurrence scse --prelude 0-3 --core 10-17 --coda 18-21

EXPORT is an export of a model.recurrence=untied model (scse-export, the trainer's, an import).
Its layers are numbered 0..L-1 over the whole stack. The prelude and coda layers keep their
places; the core layers (one or several) become the loop's block, run as one block per step. A
range is A-B, A or none; without the three flags, the default map (McLeish et al.'s TinyLlama
map scaled to L). Layers left out are printed and recorded in OUT/retrofit.json.

New parameters start so that the model at depth 1 computes what the untied model's kept layers
compute (prelude, core once, coda, final norm, head): the output says how exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from scse_dist.cli_errors import InputError, doc_help
from scse_dist.config import RunConfig
from scse_dist.convert.layer_map import LayerMap, default_map, layer_map
from scse_dist.model.config import ModelConfig
from scse_dist.typed_yaml import ConfigError

if TYPE_CHECKING:
    import torch

RECORD_NAME = "retrofit.json"  # in the retrofitted export: the map and what depth 1 computes

# Per recurrence, the fields that make depth 1 compute the kept stack (docs/retrofit.md):
#   looped    x_1 = Phi(s): the state starts at the source, nothing injected.
#   additive  x_1 = F(x_0 + s) with x_0 = 0: F(s).
#   scse      h_1 = h* + m(D_0) (Phi(h* + D_0) - Phi(h*)) with h* = a(s), a = 0 at the start:
#             Phi(0) = 0 (no biases; RMSNorm(0) = 0), D_0 = s, so h_1 = Phi(s).
DEPTH_ONE_FIELDS: dict[str, dict[str, Any]] = {
    "looped": {"inject": "none", "init_state": "source"},
    "additive": {"inject": "add", "init_state": "zeros"},
    "scse": {"inject": "none", "init_state": "source", "anchor": "learned", "anchor_scale": "free",
             "forcing_bias_scale": 0.0, "zero_mask": True},
}


def source_layers(m: ModelConfig) -> list[str]:
    """The state-dict prefix of each block, prelude, core, coda: of an untied model each of its
    layers 0..L-1 (its core holds model.depth groups under untied_match depth)."""
    groups = m.depth if m.recurrence == "untied" and m.untied_match == "depth" else 1
    return ([f"prelude.{i}." for i in range(m.n_prelude)]
            + [f"core.blocks.{i}." for i in range(m.n_core * groups)]
            + [f"coda.{i}." for i in range(m.n_coda)])


def retrofit_model(m: ModelConfig, recurrence: str, layers: LayerMap, depth: int) -> ModelConfig:
    if recurrence not in DEPTH_ONE_FIELDS:
        raise ConfigError(f"--recurrence: retrofit builds {', '.join(DEPTH_ONE_FIELDS)}; got "
                          f"{recurrence!r}")
    return dataclasses.replace(
        m, recurrence=recurrence, n_prelude=len(layers.prelude), n_core=len(layers.core),
        n_coda=len(layers.coda), depth=depth, residual_depth=0, untied_match="depth",
        loop_stability=0.0, **DEPTH_ONE_FIELDS[recurrence])


def _block_scales(m: ModelConfig) -> tuple[float, float, bool]:
    """(alpha, beta, beta in the forward) of m's blocks."""
    import torch

    from scse_dist.model.blocks import Block

    with torch.device("meta"):
        block = Block(m)
    return block.alpha, block.beta, block.forward_scale


def _rescaled(block: dict[str, torch.Tensor], old: ModelConfig, new: ModelConfig
              ) -> dict[str, torch.Tensor]:
    """One block's tensors for `new`'s residual constants, computing what they computed under
    `old`'s. Post-LN: LN(alpha' h + G'(h)) = LN(c (alpha h + G(h))) with c = alpha'/alpha when G's
    output matrices carry c (and beta/beta' where beta acts in the forward); RMSNorm drops c up to
    its eps. Pre-LN: alpha = beta = 1, the tensors as they are."""
    (a0, b0, fwd), (a1, b1, _) = _block_scales(old), _block_scales(new)
    if (a0, b0) == (a1, b1):
        return block
    c, r = a1 / a0, (b0 / b1 if fwd else 1.0)
    out = dict(block)
    for name in ("attn.proj.weight", "mlp.down.weight"):
        out[name] = block[name] * (c * r)
    if fwd:
        q, k = old.n_heads * old.resolved_head_dim, old.resolved_n_kv_heads * old.resolved_head_dim
        qkv = block["attn.qkv.weight"].clone()
        qkv[q + k:] *= r  # the value rows
        out["attn.qkv.weight"] = qkv
        for name in ("mlp.gate.weight", "mlp.up.weight"):
            out[name] = block[name] * r
    return out


def retrofit_weights(state: dict[str, torch.Tensor], old: ModelConfig, new: ModelConfig,
                     layers: LayerMap) -> dict[str, torch.Tensor]:
    """The looped model's state dict from the untied one's: kept blocks moved (and rescaled
    under Post-LN), embedding, final norm and head as they are, new parameters at their
    depth-1-exact start."""
    import torch

    sources, targets = source_layers(old), source_layers(new)
    out = {k: v for k, v in state.items()
           if not k.startswith(("prelude.", "core.", "coda."))}
    for layer, target in zip(layers.kept, targets):
        prefix = sources[layer]
        block = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        out.update({target + k: v for k, v in _rescaled(block, old, new).items()})
    if new.recurrence == "scse":  # a(s) = 0 s: h* = 0 until training moves it
        out["core.anchor.weight"] = torch.zeros(new.d_model, new.d_model)
    return out


def depth_one_note(old: ModelConfig) -> str:
    if old.residual == "preln":
        return "depth 1 computes the kept layers exactly"
    return ("depth 1 computes the kept layers up to RMSNorm's eps (Post-LN: the residual "
            "constants of the new depth are folded into each block's output matrices)")


def _check_source(export: Path, m: ModelConfig) -> None:
    if m.recurrence != "untied":
        raise InputError(f"{str(export)!r} holds a recurrence={m.recurrence} model; "
                         "retrofit reads an untied export (model.recurrence: untied)")


def retrofit(export_dir: str, out_dir: str, recurrence: str, prelude: Optional[str] = None,
             core: Optional[str] = None, coda: Optional[str] = None, depth: int = 4
             ) -> dict[str, Any]:
    """Write the retrofitted export to `out_dir` (whole or not at all) and return its record
    (what retrofit.json holds). prelude/core/coda: flag syntax, all three or none (the default
    map). ConfigError (exit 2) for a bad map, before anything is read beyond the config."""
    from scse_dist.checkpoint.export import load_export_config, not_an_export

    given = [x is not None for x in (prelude, core, coda)]
    if any(given) and not all(given):
        raise ConfigError("--prelude, --core, --coda: give all three (none for an empty part) or "
                          "none of them (the default map)")
    if depth < 1:
        raise ConfigError(f"--depth: must be >= 1, got {depth}")
    export = Path(export_dir)
    reason = not_an_export(export)
    if reason:
        raise FileNotFoundError(reason)
    if Path(out_dir).resolve() == export.resolve():
        raise ConfigError("--out: names the input export; give a new folder")
    cfg = load_export_config(export)
    _check_source(export, cfg.model)
    n_layers = len(source_layers(cfg.model))
    layers = default_map(n_layers) if prelude is None else \
        layer_map(n_layers, prelude, core or "", coda or "")
    new_cfg = dataclasses.replace(cfg, model=retrofit_model(cfg.model, recurrence, layers, depth))
    from scse_dist.config import check_model

    check_model(new_cfg.model)
    return _write(export, out_dir, cfg.model, new_cfg, layers)


def _write(export: Path, out_dir: str, old: ModelConfig, new_cfg: RunConfig, layers: LayerMap
           ) -> dict[str, Any]:
    """The export of `new_cfg` (the source's config with the retrofitted model) from the source
    export of model `old`."""
    from scse_dist.atomic import atomic_write_text, output_dir
    from scse_dist.checkpoint.export import (
        WEIGHTS_NAME,
        describe_mismatch,
        read_export_weights,
        save_exported_model,
        weights_mismatch,
    )

    state = read_export_weights(export / WEIGHTS_NAME)
    new_state = retrofit_weights(state, old, new_cfg.model, layers)
    import torch

    from scse_dist.model import LoopedLM

    with torch.device("meta"):
        problems = weights_mismatch(LoopedLM(new_cfg.model).state_dict(), new_state)
    if problems:
        raise InputError(f"{str(export)!r}: its weights do not fit its config.yaml; "
                         f"{describe_mismatch(problems)}")
    record = {"source": str(export), "n_layers": layers.n_layers, **layers.record(),
              "recurrence": new_cfg.model.recurrence,
              "fields": DEPTH_ONE_FIELDS[new_cfg.model.recurrence],
              "depth_one": depth_one_note(old)}
    tokenizer = new_cfg.data.tokenizer if os.path.isfile(new_cfg.data.tokenizer) else None

    def made_here(url: str) -> bool:
        return (Path(url) / WEIGHTS_NAME).is_file()

    with output_dir(out_dir, made_here, WEIGHTS_NAME) as tmp:
        save_exported_model(new_state, new_cfg, tmp, tokenizer=tokenizer)
        atomic_write_text(Path(tmp) / RECORD_NAME, json.dumps(record, indent=2) + "\n")
    return record


# ---------------------------------------------------------------------------- the command


def add_retrofit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`retrofit` under a command's subparsers (run_retrofit runs it)."""
    p = subparsers.add_parser("retrofit", help="a looped model from an untied export by a layer "
                              "map", **doc_help(__doc__ or ""))
    p.add_argument("export", metavar="EXPORT", help="an untied export dir")
    p.add_argument("--out", required=True, help="the retrofitted export dir to write")
    p.add_argument("--recurrence", required=True, choices=sorted(DEPTH_ONE_FIELDS))
    for part in ("prelude", "core", "coda"):
        p.add_argument(f"--{part}", default=None, metavar="A-B",
                       help=f"layers of the {part}: A-B, A or none (default: the default map)")
    p.add_argument("--depth", type=int, default=4,
                   help="model.depth of the result, the nominal loop depth (default 4)")
    return p


def run_retrofit(args: argparse.Namespace) -> int:
    record = retrofit(args.export, args.out, args.recurrence, args.prelude, args.core, args.coda,
                      args.depth)
    left = ", ".join(map(str, record["left_out"])) or "none"
    layers = LayerMap(record["n_layers"], *(range(r[0], r[-1] + 1) if r else range(0)
                                            for r in (record["prelude"], record["core"],
                                                      record["coda"])))
    print(f"scse-convert retrofit: {args.export} -> {args.out} ({record['recurrence']}: "
          f"{layers.describe()})")
    print(f"layers left out: {left}")
    print(f"{record['depth_one']} (fields: "
          + ", ".join(f"{k}={v}" for k, v in record["fields"].items()) + ")", flush=True)
    return 0

