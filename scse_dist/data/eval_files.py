"""`scse-data fetch-eval`: fetch a study's evaluation files from the Hugging Face Hub at pinned
revisions, check each against the sha256 (and size and row count) its manifest records, and
prepare it in the format the evaluation tasks read. Needs network (or `--source DIR`, a local
mirror laid out as DIR/<repo>/<path>: what the tests use).

A manifest (configs/eval/gpu.json) lists files: {out, repo, revision, path, bytes, rows, sha256,
format}; format `parquet-lines` joins a parquet's `text` column unchanged (WikiText's rows keep
their own newlines, so the join is the raw `wiki.*.raw` file), `copy` keeps the file as it is.
A checksum that does not match is bad input (exit 65) and nothing is written; so is a file whose
sha256 the manifest has not recorded yet, unless --accept-unrecorded (its sha256 is printed to be
recorded). OUT gets the prepared files and OUT/checksums.sha256 (each output's sha256), written
together or not at all.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

from scse_dist.cli_errors import InputError

CHECKSUMS = "checksums.sha256"
FORMATS = ("parquet-lines", "copy")


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(path: str | Path) -> list[dict[str, Any]]:
    try:
        files = json.loads(Path(path).read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not an evaluation-file manifest ({exc})") from None
    for entry in files:
        if entry.get("format") not in FORMATS or not all(
                entry.get(k) for k in ("out", "repo", "revision", "path")):
            raise InputError(f"{path}: entry {entry.get('out')!r}: needs out, repo, revision, "
                             f"path and a format of {', '.join(FORMATS)}")
    return files


def _download(entry: dict, source: Optional[str]) -> Path:
    """The file as fetched: from the local mirror, or from the Hub at its revision."""
    if source is not None:
        local = Path(source) / entry["repo"] / entry["path"]
        if not local.is_file():
            raise FileNotFoundError(f"{local}: no such file (--source mirror)")
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(entry["repo"], entry["path"], repo_type="dataset",
                                revision=entry["revision"]))


def _rows(entry: dict, path: Path) -> list[str]:
    if entry["format"] == "parquet-lines":
        import pyarrow.parquet as pq

        return [str(t) for t in pq.read_table(path, columns=["text"]).column("text").to_pylist()]
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def check(entry: dict, path: Path, accept_unrecorded: bool) -> tuple[str, list[str]]:
    """(sha256, rows) of a fetched file; InputError when its sha256, size or rows differ from
    the manifest's, or (without accept_unrecorded) when the manifest has no sha256 for it."""
    name = f"{entry['repo']}/{entry['path']}@{entry['revision'][:12]}"
    found = sha256_of(path)
    want = entry.get("sha256")
    if want and found != want:
        raise InputError(f"{name}: sha256 {found}, the manifest records {want}")
    size = path.stat().st_size
    if entry.get("bytes") and size != entry["bytes"]:
        raise InputError(f"{name}: {size} bytes, the manifest records {entry['bytes']}")
    rows = _rows(entry, path)
    if entry.get("rows") and len(rows) != entry["rows"]:
        raise InputError(f"{name}: {len(rows)} rows, the manifest records {entry['rows']}")
    if not want and not accept_unrecorded:
        raise InputError(f"{name}: no sha256 recorded in the manifest; this file's is {found} "
                         f"({size} bytes, {len(rows)} rows): check it, record it, or give "
                         "--accept-unrecorded")
    return found, rows


def fetch_eval(manifest: str | Path, out: str | Path, source: Optional[str] = None,
               accept_unrecorded: bool = False) -> list[str]:
    """Fetch, check and prepare every file of the manifest into `out`; the lines printed."""
    from scse_dist.atomic import output_dir

    entries = read_manifest(manifest)
    fetched = [(e, _download(e, source)) for e in entries]
    checked = [(e, p, *check(e, p, accept_unrecorded)) for e, p in fetched]  # all, then write
    lines = []
    with output_dir(str(out), lambda u: (Path(u) / CHECKSUMS).is_file(), CHECKSUMS) as tmp:
        sums = []
        for entry, path, digest, rows in checked:
            target = Path(tmp) / entry["out"]
            if entry["format"] == "copy":
                shutil.copyfile(path, target)
            else:
                target.write_text("".join(rows), encoding="utf-8")
            sums.append(f"{sha256_of(target)}  {entry['out']}")
            recorded = "checked" if entry.get("sha256") else "NOT RECORDED, record it"
            lines.append(f"{entry['out']}: {len(rows)} rows from {entry['repo']}/{entry['path']} "
                         f"(sha256 {digest}, {recorded})")
        (Path(tmp) / CHECKSUMS).write_text("\n".join(sums) + "\n", encoding="utf-8")
    return lines + [f"wrote {out}/{CHECKSUMS}"]
