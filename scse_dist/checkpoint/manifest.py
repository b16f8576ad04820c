"""Checkpoint manifests: every file of a tag with its size and xxh3-64 hash, written before the tag
is renamed into place and checked before a resume (`verify_tag`). xxh3-64: the fastest of the
hashes measured (docs/checkpoints.md), and it only has to catch truncation and corruption.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import xxhash

from scse_dist.atomic import atomic_write_text

MANIFEST_NAME = "manifest.json"
# the resolved config of the run that saved a tag (see train.start.resume)
CONFIG_NAME = "config.json"
# A tag's name and its step record (here, without torch, for scse-ckpt).
TAG_PREFIX = "step-"
META_NAME = "scse_meta.json"
HASH_NAME = "xxh3_64"
# Derived from a committed tag later (reshard.py), so not part of what the manifest vouches for.
UNIVERSAL_DIR = "universal"
_DERIVED = (UNIVERSAL_DIR, f".tmp-{UNIVERSAL_DIR}")
_CHUNK = 8 << 20


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)  # one buffer reused: no 8 MiB allocation per read
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def tag_files(tag_dir: Path) -> list[str]:
    """Every file under `tag_dir` (relative POSIX paths, sorted), the manifest itself excepted."""
    return sorted(path for path in (p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                                     if p.is_file() and p.name != MANIFEST_NAME)
                  if path.split("/", 1)[0] not in _DERIVED)


def share_of(files: list[str], index: int, count: int) -> list[str]:
    """The files hashed by sharer `index` of `count` processes that see the same directory."""
    return files[index::count]


def hash_files(tag_dir: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (tag_dir / name).stat().st_size, HASH_NAME: file_hash(tag_dir / name)}
            for name in names}


def write_manifest(tag_dir: Path, entries: dict[str, dict]) -> None:
    """Write `entries` (the union of every sharer's hash_files) as tag_dir/manifest.json."""
    text = json.dumps({"hash": HASH_NAME, "files": dict(sorted(entries.items()))}, indent=1)
    atomic_write_text(tag_dir / MANIFEST_NAME, text)


@dataclass
class TagStatus:
    """`ok`: every file matches; `no manifest`: saved before manifests (accepted); else broken."""

    problem: Optional[str] = None  # one phrase naming the file, for a broken tag
    has_manifest: bool = True

    @property
    def intact(self) -> bool:
        return self.problem is None

    def __str__(self) -> str:
        if self.problem is not None:
            return f"broken: {self.problem}"
        return "ok" if self.has_manifest else "no manifest"


def verify_tag(tag_dir: Path) -> TagStatus:
    """Check every file of tag_dir against its manifest: missing, short/long, differing, extra.

    Sizes are checked for all files before any is hashed, so a truncated file is found at once."""
    path = tag_dir / MANIFEST_NAME
    if not tag_dir.is_dir():
        return TagStatus(f"{tag_dir.name} does not exist")
    if not path.is_file():
        return TagStatus(has_manifest=False)
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        algorithm = manifest["hash"]
        if not isinstance(files, dict) or not all(
                isinstance(e, dict) and type(e.get("size")) is int for e in files.values()):
            raise ValueError("'files' must map each name to its size and hash")
    except (ValueError, KeyError, TypeError) as err:
        return TagStatus(f"{MANIFEST_NAME} is unreadable ({err})")
    if algorithm != HASH_NAME:
        return TagStatus(f"{MANIFEST_NAME} uses hash {algorithm!r}, this version reads {HASH_NAME}")
    for name, entry in files.items():
        if not (tag_dir / name).is_file():
            return TagStatus(f"{name} is missing")
        size = (tag_dir / name).stat().st_size
        if size != entry["size"]:
            return TagStatus(f"{name} is {size} bytes, manifest says {entry['size']}")
    # A file the save did not write (another world size's shards, say) can mislead DeepSpeed.
    extra = [name for name in tag_files(tag_dir) if name not in files]
    if extra:
        return TagStatus(f"{extra[0]} is not in the manifest")
    for name, entry in files.items():
        if file_hash(tag_dir / name) != entry.get(HASH_NAME):
            return TagStatus(f"{name} differs from the manifest ({HASH_NAME} mismatch)")
    return TagStatus()
