"""Run directories on remote storage: an `output_dir` that is an fsspec URL (s3://, gs://, ...).

A remote run works in a node-local staging dir (`$SCSE_STAGING_DIR/<name>`, default
`<system temp>/scse-staging/<name>`) and mirrors it: the remote `latest` tag is fetched at the
start; each checkpoint is uploaded in the background, verified, and only then named by the remote
`latest`; a tag that fails stays in staging and is retried (docs/checkpoints.md). A local
output_dir is used in place (`RunStorage.remote` is None).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import fsspec

from scse_dist.checkpoint.export import is_remote
from scse_dist.distributed import barrier, is_rank0, local_rank
from scse_dist.run_dir import CHECKPOINTS_NAME, CONFIG_NAME, METRICS_NAME, RunDir

STAGING_ENV = "SCSE_STAGING_DIR"
UPLOAD_ATTEMPTS_ENV = "SCSE_UPLOAD_ATTEMPTS"  # tries per file (default 5)
UPLOAD_BACKOFF_ENV = "SCSE_UPLOAD_BACKOFF_S"  # first wait between tries, doubled each time (0.5)
LATEST = f"{CHECKPOINTS_NAME}/latest"  # paths relative to the run dir, local or remote


def _tag(tag: str) -> str:
    return f"{CHECKPOINTS_NAME}/{tag}"


def _retry(what: str, action: Callable[[], Any]) -> Any:
    """`action()`, retried on any error with exponential backoff (backoff, 2x, 4x, ... seconds)."""
    attempts = max(1, int(os.environ.get(UPLOAD_ATTEMPTS_ENV, "5")))
    backoff = float(os.environ.get(UPLOAD_BACKOFF_ENV, "0.5"))
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as err:  # s3fs/gcsfs raise OSError mostly, botocore sometimes its own
            if attempt == attempts:
                raise OSError(f"{what}: {' '.join(str(err).split()) or type(err).__name__} "
                              f"(after {attempts} attempts)") from err
            time.sleep(backoff * 2 ** (attempt - 1))


class RunStorage:
    """The run dir the trainer writes (`local`) and, for a remote output_dir, its mirror URL."""

    def __init__(self, run_url: str, name: str, staging_root: Optional[str] = None, keep: int = 2):
        self.remote: Optional[str] = run_url.rstrip("/") if is_remote(run_url) else None
        # Tags saved here that are not (verified) remote yet: {tag: (local dir, manifest)}.
        self._pending: dict[str, tuple[Path, dict[str, int]]] = {}
        self._thread: Optional[threading.Thread] = None
        self.keep = keep  # remote tags kept (train.checkpoint.keep)
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
        return cls(cfg.run_dir, cfg.name, keep=cfg.train.checkpoint.keep)

    def _url(self, relative: str) -> str:
        return f"{self._root}/{relative}"

    def _upload(self, relative: str, source: Optional[Path] = None,
                after_file: Optional[Callable[[], None]] = None) -> None:
        """Copy local `source` (default: staging/`relative`; a file, or a dir's files recursively)
        to remote `relative`, each file retried with backoff."""
        source = self.local / relative if source is None else source
        files = [source] if source.is_file() else \
            sorted(p for p in source.rglob("*") if p.is_file())
        for path in files:
            inner = path.relative_to(source).as_posix() if path != source else ""
            target = self._url(f"{relative}/{inner}" if inner else relative)
            _retry(f"uploading {path} to {self.remote}",
                   lambda: self.fs.put_file(str(path), target))
            if after_file is not None:
                after_file()

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
            self._download(_tag(tag), missing_only=True)

    def fetch_latest(self) -> Optional[str]:
        """Download the remote `latest` tag into staging unless it is there; all ranks call this."""
        tag = None
        if self.remote is not None and local_rank() == 0:
            tag = self._fetch_latest()
        barrier()
        return tag

    def _fetch_latest(self) -> Optional[str]:
        latest = self._url(LATEST)
        try:
            if not self.fs.isfile(latest):
                return self._staging_tag() if self._staging_is_newer(None) else None
            tag = self.fs.cat_file(latest).decode().strip()
            if self._staging_is_newer(tag):
                return self._staging_tag()
            if not (RunDir(self.local).checkpoints / tag).is_dir():
                if not self.fs.isdir(self._url(_tag(tag))):
                    raise RuntimeError(f"{self.remote}/{LATEST} names {tag!r}, which "
                                       f"does not exist in {self.remote}/{CHECKPOINTS_NAME}")
                self._download(_tag(tag))
                if self.fs.isfile(self._url(METRICS_NAME)):  # the resumed run appends to it
                    self._download(METRICS_NAME)
            self._download(LATEST)
        except OSError as err:
            raise OSError(f"reading {self.remote} (output_dir): {err}") from err
        print(f"staging {self.remote} in {self.local}: checkpoint {tag}", flush=True)
        return tag

    def _staging_tag(self) -> Optional[str]:
        latest = RunDir(self.local).checkpoints / "latest"
        return latest.read_text().strip() if latest.is_file() else None

    def _staging_is_newer(self, remote_tag: Optional[str]) -> bool:
        """Staging holds a newer committed tag than the remote `latest` (its upload failed): resume
        from it and upload it again."""
        tag = self._staging_tag()
        if not tag or not (path := RunDir(self.local).checkpoints / tag).is_dir() or \
                (remote_tag is not None and tag <= remote_tag):
            return False
        self._pending[tag] = (path, {p.relative_to(path).as_posix(): p.stat().st_size
                                     for p in path.rglob("*") if p.is_file()})
        print(f"staging {self.local} holds {tag}, newer than the remote latest "
              f"({remote_tag or 'none'}) of {self.remote}: resuming from staging, uploading it "
              "at the next save", flush=True)
        return True

    # ---------------------------------------------------------------- checkpoint uploads
    def wait(self) -> None:
        """Block until this node's upload in flight (if any) has finished, succeeded or not."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def not_uploaded(self) -> set[str]:
        """Tags this node holds that the remote lacks: local pruning must keep them."""
        return set(self._pending)

    def start_upload(self, tag: str, source: Path, manifest: dict[str, int],
                     faults: Any = None) -> None:
        """Upload this node's copy of `tag` (in `source`) in a background thread, after any tag an
        earlier upload failed on; rank 0 then verifies it against `manifest` and publishes it."""
        if self.remote is None or local_rank() != 0 or not source.is_dir():
            return
        self.wait()
        self._pending[tag] = (source, manifest)
        self._thread = threading.Thread(target=self._upload_pending, args=(faults,),
                                        name="scse-upload", daemon=True)
        self._thread.start()

    def finish(self) -> list[str]:
        """At the end of a run: wait for the upload in flight, retry what is still missing once
        more, and return the tags the remote still lacks (each already reported)."""
        self.wait()
        if self._pending:
            self._upload_pending()
        return sorted(self._pending)

    def _upload_pending(self, faults: Any = None) -> None:
        published = None
        for tag in sorted(self._pending):  # oldest first: a failed earlier tag is retried first
            source, manifest = self._pending[tag]
            try:
                self._upload(_tag(tag), source, after_file=lambda: (
                    faults.mid_upload(int(tag.rsplit("-", 1)[-1])) if faults else None))
                if is_rank0():
                    self._verify(tag, manifest)
            except Exception as err:  # reported, not raised: training goes on (docs/checkpoints.md)
                print(f"upload of {tag} to {self.remote} failed: {' '.join(str(err).split())}; it "
                      f"stays in {source} and is retried at the next save", flush=True)
                continue
            del self._pending[tag]
            if source.name != tag:  # another node's copy under the temporary name: remote now
                shutil.rmtree(source, ignore_errors=True)
            published = tag
        if published is not None and is_rank0():
            self._publish(published)
        for tag in [t for t in self._pending if published is not None and t < published]:
            del self._pending[tag]  # the remote holds a newer complete tag: normal retention

    def _verify(self, tag: str, manifest: dict[str, int]) -> None:
        """Every file of `manifest` is in the remote tag with its size (other nodes' shards may
        still be arriving: checked again with backoff)."""
        def check() -> None:
            self.fs.invalidate_cache(self._url(_tag(tag)))
            remote = {info["name"].rsplit(f"{tag}/", 1)[-1]: info["size"]
                      for info in self.fs.find(self._url(_tag(tag)), detail=True).values()}
            wrong = sorted(n for n, size in manifest.items() if remote.get(n) != size)
            if wrong:
                raise OSError(f"{self.remote}/{_tag(tag)} lacks or has a wrong size of "
                              f"{', '.join(wrong)}")
        _retry(f"verifying {tag}", check)

    def _publish(self, tag: str) -> None:
        """Rank 0, once `tag` is complete and verified remotely: `latest`, metadata, pruning."""
        _retry("publishing latest", lambda: self.fs.pipe_file(self._url(LATEST),
                                                               tag.encode()))
        for name in (CONFIG_NAME, METRICS_NAME):
            if (self.local / name).is_file():
                self._upload(name)
        listed = self.fs.ls(self._url(CHECKPOINTS_NAME), detail=False)
        tags = sorted(p.rsplit("/", 1)[-1] for p in listed)
        steps = [t for t in tags if t.startswith("step-")]
        for old in steps[:-self.keep]:
            if old != tag and old not in self._pending:
                self.fs.rm(self._url(_tag(old)), recursive=True)

    def upload_outputs(self, *names: str) -> None:
        """Rank 0 at the end: mirror export/, eval/ and the final metrics (those that exist)."""
        if self.remote is None:
            return
        for name in names:
            if (self.local / name).exists():
                self._upload(name)
