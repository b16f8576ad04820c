"""Resume at another world size: DeepSpeed's universal checkpoint, converted once, beside the tag.

ZeRO partitions belong to the world size that saved them; `ds_to_universal` rewrites a tag as one
file per parameter, which DeepSpeed re-partitions over any world size as it loads. The first start
that needs it converts the tag into `TAG/.tmp-universal`, renamed to `TAG/universal` (inside its
tag, so retention deletes it with the tag); node-local staging converts each node's copy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from scse_dist.checkpoint.manifest import CONFIG_NAME, UNIVERSAL_DIR as UNIVERSAL
from scse_dist.config import read_saved_config
from scse_dist.distributed import barrier, is_rank0, local_rank


def convert_once(root: Path, tag: str) -> str:
    """The universal form of `root/tag`, converted now if missing (all ranks call); returns its
    tag, relative to root. Rank 0 converts first; then the first rank of any node that still
    does not see it (node-local staging of a remote output_dir) converts its own copy."""
    final = root / tag / UNIVERSAL
    if is_rank0() and not final.is_dir():
        _convert(root / tag, final)
    barrier()
    if local_rank() == 0 and not final.is_dir():
        _convert(root / tag, final)
    barrier()
    return f"{tag}/{UNIVERSAL}"


def _convert(source: Path, final: Path) -> None:
    from scse_dist.quiet import name_cpu_accelerator

    name_cpu_accelerator()
    from deepspeed.checkpoint import ds_to_universal

    tmp = final.with_name(f".tmp-{final.name}")
    if tmp.exists():  # a conversion that was killed
        shutil.rmtree(tmp)
    start = time.perf_counter()
    staged = _muon_staged(source, source.with_name(f".tmp-{source.name}-{MUON_STAGED}"))
    # one process: a process pool forked from a rank would inherit its process group
    args = argparse.Namespace(input_folder=str(staged or source), output_folder=str(tmp),
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        ds_to_universal.main(args)
    os.replace(tmp, final)
    if staged:
        shutil.rmtree(staged)
    print(f"converted {source} to a universal checkpoint {final} in "
          f"{time.perf_counter() - start:.1f} s", flush=True)


def load_universal(engine: Any, root: Path, tag: str) -> tuple[Any, Any]:
    """engine.load_checkpoint of a universal tag. DeepSpeed reads `checkpoint.load_universal`
    only while loading, so it is switched on for this load alone: the run's own saves stay
    ordinary tags at the new world size."""
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        loaded = engine.load_checkpoint(str(root), tag=tag)
    finally:
        config.load_universal_checkpoint = False
    _restore_muon_momentum(engine)
    return loaded


# Muon at ZeRO-1/2: ds_to_universal reads exp_avg and exp_avg_sq from every param group, but a
# Muon group's momentum_buffer spans whole matrices, not the partition. The conversion reads a
# staged copy of the tag in which each Muon group carries zero moments of the partition's size;
# they are dropped after the load, so Muon's momentum restarts from zero.
MUON_STAGED = "muon-staged"
MOMENTUM = "momentum_buffer"


def _muon_staged(source: Path, staged: Path) -> Path | None:
    """The staged copy of tag `source` when its run used Muon, else None."""
    run_config = read_saved_config(source / CONFIG_NAME) if (source / CONFIG_NAME).is_file() else {}
    if run_config.get("train", {}).get("optimizer", {}).get("kind") != "muon":
        return None
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    for path in source.iterdir():
        if path.name.startswith(".") or path.name == UNIVERSAL:
            continue
        if path.name.endswith("optim_states.pt"):
            torch.save(_without_momentum(torch.load(path, map_location="cpu", weights_only=False)),
                       staged / path.name)
        else:
            (staged / path.name).symlink_to(path.resolve(), target_is_directory=path.is_dir())
    return staged


def _without_momentum(state: dict) -> dict:
    optim = state["optimizer_state_dict"]
    for index, group in optim["base_optimizer_state"]["state"].items():
        if group.pop(MOMENTUM, None) is not None:
            zeros = torch.zeros_like(optim["single_partition_of_fp32_groups"][index])
            group["exp_avg"], group["exp_avg_sq"] = zeros, zeros.clone()
    return state


def _restore_muon_momentum(engine: Any) -> None:
    """Drop the zero moments a loaded Muon group got from _muon_staged: its momentum_buffer is
    made afresh (zeros) at the next step."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    muon = [g for g in getattr(optimizer, "param_groups", []) if g.get("use_muon")]
    for group in muon:
        optimizer.state.pop(group["params"][0], None)
    if muon and is_rank0():
        print("train.optimizer.kind: muon: Muon's momentum restarts from zero at the new world "
              "size (AdamW's moments and the weights carry over)", flush=True)
