"""Checkpoints: DeepSpeed save/resume under run_dir/checkpoints, retention, and the final export.

A tag `step-{N:07d}`'s client_state carries the step, every rank's data position and RNG, the
config and the callbacks' states. Saving is atomic: every rank writes `.tmp-step-N`; after a
barrier rank 0 adds `config.json` and `manifest.json`, renames it to `step-N`, then replaces
`latest`, so a kill at any point leaves `latest` naming a complete checkpoint.

A write that fails for want of space (scse_dist.atomic.NoSpaceError) on any rank is agreed at
the save's next collective: every rank raises it, rank 0 removes `.tmp-step-N`, and `latest` and
the tags before it are as they were.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import AbstractSet, Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from scse_dist.atomic import NoSpaceError, atomic_write_text, no_space
from scse_dist.checkpoint import manifest
from scse_dist.checkpoint.manifest import CONFIG_NAME, META_NAME, TAG_PREFIX
from scse_dist.config import RunConfig
from scse_dist.distributed import barrier, is_rank0, local_rank
from scse_dist.run_dir import RunDir

TMP_PREFIX = ".tmp-"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return RunDir(run_dir).checkpoints


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:07d}"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(obj: Any) -> list[Any]:
    # ZeRO-1/2 write client_state from rank 0 only, so rank 0 must hold every rank's stream state.
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    # ZeRO-3 writes client_state on every rank: each must hold the same callback states.
    if not dist.is_initialized():
        return obj
    out = [obj]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def save_checkpoint(engine: Any, run_dir: str | Path, step: int, stream: Any, config: dict,
                    keep: int, faults: Any = None, storage: Any = None,
                    callback_states: Optional[dict[str, Any]] = None) -> str:
    """Save tag step-{step} with the run's `config` (config_to_dict) atomically (all ranks call
    this), then prune to `keep` (train.checkpoint.keep); with a remote `storage`, then upload it
    (storage.start_upload). `callback_states` are rank 0's, saved for every rank."""
    if storage is not None:
        storage.wait()  # one upload in flight at most: the previous save's finishes first
    per_rank = _gather({"data": stream.state_dict(), "rng": _rng_state()})
    client_state = {"step": step, "ranks": per_rank, "config": config,
                    "callbacks": _from_rank0(callback_states or {})}
    root = checkpoint_dir(run_dir)
    tag = tag_for(step)
    tmp = root / f"{TMP_PREFIX}{tag}"
    if is_rank0() and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    _convert_no_space(engine)
    failed = None  # this rank's NoSpaceError, agreed with the others at the next collective
    try:
        engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state,
                               save_latest=False)
    except NoSpaceError as exc:
        failed = exc
        barrier()  # DeepSpeed's last barrier, where the other ranks wait: writes come before it
    if is_rank0() and failed is None:  # meta: read before DeepSpeed loads anything, to refuse
        # a world-size change clearly
        failed = _written(tmp / META_NAME, json.dumps({"step": step, "world_size": len(per_rank)}))
        failed = failed or _written(tmp / CONFIG_NAME, json.dumps(client_state["config"], indent=1))
    if faults is not None:
        faults.mid_save(step)
    _agree(failed, tmp)  # every rank has written its shard: only now may the tag become visible
    entries = _hash_tag(tmp, storage)
    # {file: size} of the whole tag and (on rank 0) the manifest: what an upload is verified against
    tag_sizes = {name: entry["size"] for name, entry in entries.items()}
    remote = storage is not None and storage.remote is not None
    if is_rank0():
        try:
            manifest.write_manifest(tmp, entries)
            tag_sizes[manifest.MANIFEST_NAME] = (tmp / manifest.MANIFEST_NAME).stat().st_size
            final = root / tag
            if final.exists():  # an earlier run reached this step but died before updating latest
                shutil.rmtree(final)
            os.replace(tmp, final)
            atomic_write_text(root / "latest", tag)  # readers see the old or the new name
            prune_checkpoints(run_dir, keep, protect=storage.not_uploaded() if remote else set())
        except NoSpaceError as exc:
            failed = exc
    _agree(failed, tmp)
    if remote:  # rank 0's copy is renamed; another node's shards are still under the tmp name
        storage.start_upload(tag, root / tag if is_rank0() else tmp, tag_sizes, faults)
    return tag


def _convert_no_space(engine: Any) -> None:
    """DeepSpeed's checkpoint files are written by torch.save, which reports a full disk as a
    RuntimeError: each file's write raises NoSpaceError naming the file instead."""
    writer = engine.checkpoint_engine
    if getattr(writer, "_scse_no_space", False):
        return
    save = writer.save

    def converted(state_dict: Any, path: str) -> Any:
        with no_space(path):
            return save(state_dict, path)

    writer.save, writer._scse_no_space = converted, True


def _written(path: Path, text: str) -> Optional[NoSpaceError]:
    """`text` as `path` (inside the temporary tag); the NoSpaceError if it did not fit."""
    try:
        with no_space(path):
            path.write_text(text)
    except NoSpaceError as exc:
        return exc
    return None


def _agree(failed: Optional[NoSpaceError], tmp: Optional[Path] = None) -> None:
    """A collective (in place of a barrier): when a write failed on any rank, every rank raises
    (the first failing rank's line) and rank 0 removes the temporary tag `tmp`."""
    lines = [line for line in _gather(str(failed) if failed else None) if line]
    if not lines:
        return
    if is_rank0() and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    raise failed or NoSpaceError(f"{lines[0]} (on another rank)")


def _hash_tag(tmp: Path, storage: Any) -> dict[str, Any]:
    """Every rank hashes its share of the tag's files (node-local staging: each node's first rank
    its node's); every rank gets the union, the manifest's entries."""
    if storage is not None and storage.remote is not None:
        index, count = (0, 1) if local_rank() == 0 else (0, 0)
    else:
        index, count = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    files = manifest.tag_files(tmp) if count else []
    shares = _gather(manifest.hash_files(tmp, manifest.share_of(files, index, count))
                     if count else {})
    return {name: entry for share in shares for name, entry in share.items()}


def remove_partial_saves(run_dir: str | Path) -> list[Path]:
    """Delete `.tmp-*` leftovers of saves that were killed (rank 0, before any new save). Only
    the holder of the run dir's lock (scse_dist.run_lock) calls this: no other writer is alive."""
    root = checkpoint_dir(run_dir)
    stale = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return stale


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(TAG_PREFIX))


def prune_checkpoints(run_dir: str | Path, keep: int, protect: AbstractSet[str] = frozenset()
                      ) -> list[Path]:
    """Delete all but the newest `keep` step-* tags (never the one `latest` names, nor `protect`:
    tags a remote run dir lacks)."""
    root = checkpoint_dir(run_dir)
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    old = [p for p in list_checkpoints(run_dir)[:-keep]
           if p.name != latest and p.name not in protect]
    for path in old:
        shutil.rmtree(path)
    return old


def resume_if_present(engine: Any, run_dir: str | Path, stream: Any, named: Optional[str]
                      ) -> tuple[int, dict[str, Any]]:
    """Load checkpoint tag `named` (verified and agreed by resume.plan_resume; None: none) and
    return the step to continue from (0 if none) and the callbacks' saved states ({} if none;
    a tag saved before callbacks had states holds none)."""
    root = checkpoint_dir(run_dir)
    if named is None:
        return 0, {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    meta = root / named / META_NAME
    saved_world = json.loads(meta.read_text())["world_size"] if meta.is_file() else world
    if saved_world != world and engine.zero_optimization_stage() > 0:
        # ZeRO partitions belong to one world size: load DeepSpeed's universal form of the tag
        from scse_dist.checkpoint.reshard import convert_once, load_universal

        path, client_state = load_universal(engine, root, convert_once(root, named))
    else:  # ZeRO-0 keeps whole states: any world size loads them as they are
        path, client_state = engine.load_checkpoint(str(root), tag=named)
    if path is None or client_state is None:
        raise RuntimeError(f"{root}: DeepSpeed could not load checkpoint {named!r}")
    step = int(client_state["step"])
    ranks = client_state["ranks"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    # every old rank's data position: at another world size the new readers share out the rest
    stream.resume([r["data"] for r in ranks])
    _set_rng_state(ranks[rank % len(ranks)]["rng"])
    if saved_world != world and is_rank0():
        print(f"{root / named}: saved by {saved_world} ranks, resumed by {world} (the global batch "
              "and LR schedule continue; the data position is exact, see docs/data.md)", flush=True)
    if is_rank0():
        print(f"resumed {path} at step {step} (data stream and RNG restored)", flush=True)
    return step, dict(client_state.get("callbacks") or {})


def export_final(engine: Any, cfg: RunConfig, run_dir: str | Path, tag: str,
                 storage: Any = None, faults: Any = None) -> Optional[str]:
    """Consolidate checkpoint `tag` to fp32 weights on CPU (any ZeRO stage, rank 0 alone) and
    export them with the run's tokenizer; returns the export dir on rank 0, None elsewhere."""
    from scse_dist.checkpoint.export import save_exported_model
    from scse_dist.checkpoint.zero_weights import fp32_state_dict

    out: Optional[str] = None
    failed = None
    if is_rank0():
        if storage is not None:  # a remote run: other nodes' shards may exist only remotely
            storage.complete_tag(tag)
        state_dict = fp32_state_dict(engine, checkpoint_dir(run_dir), tag)
        try:
            out = save_exported_model(
                state_dict, cfg, str(RunDir(run_dir).export), tokenizer=cfg.data.tokenizer,
                after_weights=None if faults is None
                else lambda: faults.mid_export(int(tag.rsplit("-", 1)[-1])))
        except NoSpaceError as exc:  # the export as it was; the checkpoint is saved
            failed = exc
    _agree(failed)  # in place of a barrier: every rank stops when rank 0's export did not fit
    return out
