"""`scse-ckpt`: check a run's checkpoints against their manifests.

    scse-ckpt list RUN_DIR     each tag: step, world size, ZeRO stage, size, status; which is
                               `latest`; exit 1 if any tag is broken
    scse-ckpt verify RUN_DIR   one line per tag; exit 1 if any tag is broken

RUN_DIR is a run dir, or its checkpoints/ dir. Status: `ok`, `no manifest` (saved before
manifests: not verifiable) or `broken: <the file and what is wrong>`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from scse_dist.checkpoint.manifest import CONFIG_NAME, META_NAME, TAG_PREFIX, verify_tag
from scse_dist.cli_errors import cli_main
from scse_dist.config import read_saved_config
from scse_dist.run_dir import RunDir

EXIT_BROKEN = 1


def checkpoints_root(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such run dir")
    if RunDir(root).checkpoints.is_dir():
        return RunDir(root).checkpoints
    if (root / "latest").is_file() or any(root.glob(f"{TAG_PREFIX}*")):
        return root
    raise FileNotFoundError(f"{root}: no checkpoints/ here (give a run dir or its checkpoints/)")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _size(tag_dir: Path) -> str:
    total: float = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
    for unit in ("B", "KiB", "MiB"):
        if total < 1024:
            return f"{total:.0f} {unit}" if unit == "B" else f"{total:.1f} {unit}"
        total /= 1024
    return f"{total:.1f} GiB"


def describe(tag_dir: Path) -> dict:
    """Step, world size and ZeRO stage (from the tag's own records; '?' where absent) and status."""
    meta = _read_json(tag_dir / META_NAME)
    train = read_saved_config(_read_json(tag_dir / CONFIG_NAME)).get("train", {})
    return {"tag": tag_dir.name, "step": meta.get("step", "?"),
            "world_size": meta.get("world_size", "?"),
            "zero_stage": train.get("engine", {}).get("zero_stage", "?"),
            "size": _size(tag_dir), "status": verify_tag(tag_dir)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scse-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("list", "each tag with step, world size, ZeRO stage, size and status"),
                       ("verify", "check every tag; exit 1 if any is broken")):
        sub.add_parser(name, help=text).add_argument("run_dir", help="run dir or its checkpoints/")
    return parser


@cli_main("scse-ckpt")
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    root = checkpoints_root(args.run_dir)
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    tags = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(TAG_PREFIX))
    if not tags:
        print(f"{root}: no checkpoints")
        return 0
    broken = 0
    for tag_dir in tags:
        info = describe(tag_dir)
        broken += not info["status"].intact
        mark = "  <- latest" if tag_dir.name == latest else ""
        if args.command == "list":
            print(f"{info['tag']}  step {info['step']}  world {info['world_size']}  "
                  f"ZeRO-{info['zero_stage']}  {info['size']}  {info['status']}{mark}")
        else:
            print(f"{info['tag']}: {info['status']}{mark}")
    if latest is not None and not (root / latest).is_dir():
        print(f"latest names {latest}, which does not exist")
        broken += 1
    return EXIT_BROKEN if broken else 0


if __name__ == "__main__":
    sys.exit(main())
