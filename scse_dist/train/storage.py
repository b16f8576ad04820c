"""Run directories on remote storage: an `output_dir` that is an fsspec URL (s3://, gs://, ...).

DeepSpeed, the metrics logger and the exporter write plain local files, so a remote run works in a
local staging dir (`$SCSE_STAGING_DIR/<name>`, default `<system temp>/scse-staging/<name>`) and
mirrors it to the remote run dir:

- start: if the remote has `checkpoints/latest` and staging lacks that tag, the tag, `latest` and
  `metrics.jsonl` are downloaded (LOCAL_RANK 0 of every node: staging is node-local).
- each checkpoint: every node uploads its own shards of the tag once all ranks have written them;
  only then does rank 0 upload `latest` (so the remote `latest` always names a complete tag),
  config.yaml and metrics.jsonl, and prune remote tags beyond `keep_checkpoints`.
- end: export/ and eval/.

A local output_dir is used in place: no staging, no copies (`RunStorage.remote` is None).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import fsspec

from scse_dist.launch.distributed import barrier

STAGING_ENV = "SCSE_STAGING_DIR"
LOCAL_PROTOCOLS = {"file", "local"}


def _local_rank() -> int:
    # init_distributed exports LOCAL_RANK for every launcher (Slurm's SLURM_LOCALID included).
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_remote(url: str) -> bool:
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    return protocol not in LOCAL_PROTOCOLS


class RunStorage:
    """The run dir the trainer writes (`local`) and, for a remote output_dir, its mirror URL."""

    def __init__(self, run_url: str, name: str, staging_root: Optional[str] = None):
        self.remote: Optional[str] = run_url.rstrip("/") if is_remote(run_url) else None
        if self.remote is None:
            self.local = Path(run_url)
            return
        try:
            self.fs, self._root = fsspec.core.url_to_fs(self.remote)
        except (ImportError, ValueError) as err:
            raise ValueError(f"output_dir: cannot open {run_url}: {err}") from err
        staging = staging_root or os.environ.get(STAGING_ENV) or \
            os.path.join(tempfile.gettempdir(), "scse-staging")
        self.local = Path(staging) / name

    @classmethod
    def for_config(cls, cfg: Any) -> "RunStorage":
        return cls(cfg.run_dir, cfg.name)

    def _url(self, relative: str) -> str:
        return f"{self._root}/{relative}"

    def _upload(self, relative: str, source: Optional[Path] = None) -> None:
        """Copy local `source` (default: staging/`relative`; a file, or a dir's files recursively)
        to remote `relative`."""
        source = self.local / relative if source is None else source
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
        for path in files:
            inner = path.relative_to(source).as_posix() if path != source else ""
            target = self._url(f"{relative}/{inner}" if inner else relative)
            try:
                self.fs.put_file(str(path), target)
            except OSError as err:
                raise OSError(f"uploading {path} to {self.remote}: {err}") from err

    def _download(self, relative: str, missing_only: bool = False) -> None:
        source = self._url(relative)
        files = [source] if self.fs.isfile(source) else self.fs.find(source)
        for remote_file in files:
            target = self.local / remote_file[len(self._root) + 1:]
            if missing_only and target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote_file, str(target))

    def complete_tag(self, tag: str) -> None:
        """Rank 0 before consolidating `tag`: fetch the other nodes' shards (node-local staging)."""
        if self.remote is not None:
            self._download(f"checkpoints/{tag}", missing_only=True)

    def fetch_latest(self) -> Optional[str]:
        """Download the remote `latest` tag into staging unless it is there; all ranks call this."""
        tag = None
        if self.remote is not None and _local_rank() == 0:
            tag = self._fetch_latest()
        barrier()
        return tag

    def _fetch_latest(self) -> Optional[str]:
        latest = self._url("checkpoints/latest")
        try:
            if not self.fs.isfile(latest):
                return None
            tag = self.fs.cat_file(latest).decode().strip()
            if not (self.local / "checkpoints" / tag).is_dir():
                if not self.fs.isdir(self._url(f"checkpoints/{tag}")):
                    raise RuntimeError(f"{self.remote}/checkpoints/latest names {tag!r}, which "
                                       f"does not exist in {self.remote}/checkpoints")
                self._download(f"checkpoints/{tag}")
                if self.fs.isfile(self._url("metrics.jsonl")):  # the resumed run appends to it
                    self._download("metrics.jsonl")
            self._download("checkpoints/latest")
        except OSError as err:
            raise OSError(f"reading {self.remote} (output_dir): {err}") from err
        print(f"staging {self.remote} in {self.local}: checkpoint {tag}", flush=True)
        return tag

    def upload_shards(self, local_tmp_tag: Path, tag: str) -> None:
        """Upload this node's files of a checkpoint written under local `local_tmp_tag` as `tag`.

        Called by every rank after all have written (so one node's ranks are all done); the final
        tag name is used remotely because the remote tag only becomes visible via `latest`.
        """
        if self.remote is not None and _local_rank() == 0 and local_tmp_tag.is_dir():
            self._upload(f"checkpoints/{tag}", local_tmp_tag)

    def drop_node_copy(self, local_tmp_tag: Path) -> None:
        """After the commit: a node whose staging is not rank 0's still holds its shards under the
        temporary name (rank 0 renamed only its own copy). They are remote now; a resume on this
        node downloads the whole tag again."""
        if self.remote is not None and _local_rank() == 0 and local_tmp_tag.is_dir():
            shutil.rmtree(local_tmp_tag)

    def commit(self, tag: str, keep: int) -> None:
        """Rank 0, after every node uploaded its shards: publish `latest`, metadata, prune."""
        if self.remote is None:
            return
        self._upload("checkpoints/latest")
        for name in ("config.yaml", "metrics.jsonl"):
            if (self.local / name).is_file():
                self._upload(name)
        tags = sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(self._url("checkpoints"), detail=False))
        steps = [t for t in tags if t.startswith("step-")]
        for old in steps[:-keep]:
            if old != tag:
                self.fs.rm(self._url(f"checkpoints/{old}"), recursive=True)

    def upload_outputs(self, *names: str) -> None:
        """Rank 0 at the end: mirror export/, eval/ and the final metrics (those that exist)."""
        if self.remote is None:
            return
        for name in names:
            if (self.local / name).exists():
                self._upload(name)
