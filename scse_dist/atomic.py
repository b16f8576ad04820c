"""The write rule, in one place: a command creates only new files or files it made itself, writes
them under a temporary name and renames them into place when it has succeeded, and a failed
command leaves the filesystem as it found it (no partial file, no empty or temporary folder).

    atomic_write(path, write)          a local file: `write(tmp)`, fsync, os.replace
    with staged_file(url) as tmp: ...  a file at any fsspec URL, renamed into place if the body
                                       succeeds (the parent folders it had to make go on failure)
    with output_dir(url, ...) as tmp:  a folder of outputs, built beside its place and moved in

Temporary names are `.tmp-NAME.HOST.PID`, so a killed writer's leftovers are never read as
outputs, and one is removed only when its writer is provably gone: its host is this host and its
pid is dead (a writer on another node of a shared file system is never taken for dead).

Out of space: a write that fails for want of space (ENOSPC, EDQUOT, EFBIG: a full disk, a quota,
a file-size limit) raises NoSpaceError naming the path and the free space; commands exit 74 on it
(scse_dist.cli_errors). Every writer here converts; `with no_space(path):` converts other writes.
For tests, `SCSE_FAULT_NO_SPACE=PATTERN[@N]` fails the Nth write (default: the first) whose path
matches the fnmatch PATTERN with ENOSPC, after the data is written and before it is renamed.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import itertools
import os
import posixpath
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# fsspec is imported where it is used: a command that only writes local files starts without it

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NO_SPACE_FAULT_ENV = "SCSE_FAULT_NO_SPACE"
# Writers that wrap the OSError in their own: safetensors says "(os error 28)"; torch.save only
# says that its stream stopped short ("unexpected pos", "file write failed").
_OS_ERROR = re.compile(r"os error (\d+)")
_TORCH_WRITE = re.compile(r"inline_container\.cc.*(unexpected pos|file write failed)", re.S)
_injected_count = 0  # writes that matched SCSE_FAULT_NO_SPACE so far in this process


class NoSpaceError(OSError):
    """A write failed for want of space (a full disk, a quota, a file-size limit): one line that
    names the path and the free space on its file system."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(errno.ENOSPC, message)
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:  # as it was, from a worker process too
        return type(self), (str(self), self.path)

    @classmethod
    def at(cls, path: str | os.PathLike) -> "NoSpaceError":
        path = os.fspath(path)
        free = _free_space(path)
        where = f"{free} free on that file system" if free else "a remote file system"
        return cls(f"no space left writing {path}: {where} (a full disk, a quota or a file-size "
                   "limit); free space and rerun the same command", path)


def _free_space(path: str) -> str:
    """Free space on the file system of local `path` (its nearest existing folder), e.g. 1.2 MB;
    "" for a URL."""
    if "://" in path and not path.startswith("file://"):
        return ""
    folder = Path(path.removeprefix("file://")).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown space"
    for unit in ("B", "kB", "MB", "GB"):
        if free < 1000:
            return f"{free:.0f} {unit}" if unit == "B" else f"{free:.1f} {unit}"
        free /= 1000
    return f"{free:.1f} TB"


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` (or an error it wraps) is a write that failed for want of space."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            if current.errno in NO_SPACE_ERRNOS:
                return True
        else:
            text = str(current)
            code = _OS_ERROR.search(text)
            if (code and int(code[1]) in NO_SPACE_ERRNOS) or _TORCH_WRITE.search(text):
                return True
        current = current.__cause__ or current.__context__
    return False


def _inject_no_space(path: str) -> None:
    """SCSE_FAULT_NO_SPACE's failed write, when `path` is the Nth that matches its pattern."""
    global _injected_count
    spec = os.environ.get(NO_SPACE_FAULT_ENV)
    if not spec:
        return
    pattern, _, nth = spec.rpartition("@") if "@" in spec else (spec, "", "1")
    if fnmatch.fnmatch(path, pattern):
        _injected_count += 1
        if _injected_count == int(nth):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@contextlib.contextmanager
def no_space(path: str | os.PathLike) -> Iterator[None]:
    """Writes to `path` in the body: one that fails for want of space raises NoSpaceError naming
    the file (the error's, else `path`); SCSE_FAULT_NO_SPACE's comes when the body has written."""
    try:
        yield
        _inject_no_space(os.fspath(path))
    except NoSpaceError:
        raise
    except Exception as exc:
        if not is_no_space(exc):
            raise
        # the file the error names, if it names one (a body may write beside `path` too)
        raise NoSpaceError.at(getattr(exc, "filename", None) or path) from exc


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """`write(tmp)` creates the temporary file (any writer that takes a path), then it replaces
    the local file `path`. The temporary file is removed when anything fails."""
    with staged_file(os.fspath(path)) as tmp:
        write(Path(tmp))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def _local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _move(fs: Any, src: str, dst: str) -> None:
    """Rename `src` to `dst`: atomic on a local disk; an object store copies the object."""
    if _local(fs):
        os.replace(src, dst)
    else:
        fs.mv(src, dst)


@contextlib.contextmanager
def _made_parents(fs: Any, path: str) -> Iterator[None]:
    """Make the missing folders above `path`; remove them again if the body fails. (An object
    store has no folders to make.)"""
    missing, parent = [], posixpath.dirname(path)
    while _local(fs) and parent and parent != posixpath.dirname(parent) and not fs.exists(parent):
        missing.append(parent)
        parent = posixpath.dirname(parent)
    if missing:
        fs.makedirs(missing[0], exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in missing:  # deepest first; one another process filled in stays
            with contextlib.suppress(OSError):
                fs.rmdir(folder)
        raise


@contextlib.contextmanager
def removed_on_failure(path: Path, keep: Callable[[BaseException], bool] = lambda exc: False
                       ) -> Iterator[None]:
    """A local folder the body makes (with the parents it lacks) is removed whole when the body
    fails, unless `keep(error)`; a folder that exists already is kept."""
    missing = list(itertools.takewhile(lambda p: not p.exists(), [path, *path.parents]))
    try:
        yield
    except BaseException as exc:
        if missing and not keep(exc):
            shutil.rmtree(missing[0], ignore_errors=True)
            for folder in missing[1:]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def _temporary(fs: Any, path: str) -> tuple[str, str]:
    """(fs path, URL) of the temporary name beside `path`."""
    parent, name = posixpath.split(path.rstrip("/"))
    tmp = posixpath.join(parent, f".tmp-{name}.{socket.gethostname()}.{os.getpid()}")
    return tmp, tmp if _local(fs) else fs.unstrip_protocol(tmp)


@contextlib.contextmanager
def staged_file(url: str) -> Iterator[str]:
    """Yield a temporary name beside the file `url` (path or fsspec URL) for the body to write;
    it becomes `url` when the body succeeds and is removed when it fails."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    tmp, tmp_url = _temporary(fs, path)
    with _made_parents(fs, tmp):
        try:
            with no_space(url):
                yield tmp_url
                if _local(fs):
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            _move(fs, tmp, path)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp)


def write_file(url: str, data: bytes) -> None:
    """`data` as the file at `url` (path or fsspec URL), whole or not at all."""
    import fsspec

    with staged_file(url) as tmp, fsspec.open(tmp, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def output_dir(url: str, made_here: Callable[[str], bool], last: str) -> Iterator[str]:
    """Yield a new temporary folder beside `url` for the body to fill; when the body succeeds
    its files go to `url`, and when it fails the folder is removed and `url` is as it was.

    A new (or empty) `url` is the temporary folder renamed. Into an existing one the files move
    one by one, the old `last` (the file naming the others) removed first and the new one moved
    last. A file already there is replaced only when `made_here(url)` says this stack wrote the
    folder; else FileExistsError before anything moves."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if fs.exists(root) and not fs.isdir(root):
        raise FileExistsError(f"{url}: exists and is not a folder; give another output")
    tmp, tmp_url = _temporary(fs, root)
    with _made_parents(fs, tmp):
        try:
            with _named_as_published(tmp_url, url), no_space(url):
                fs.makedirs(tmp, exist_ok=True)
                yield tmp_url
            _publish(fs, tmp, root, url, made_here, last)
            _remove_dead_temporaries(fs, root)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp, recursive=True)


@contextlib.contextmanager
def _named_as_published(tmp_url: str, url: str) -> Iterator[None]:
    """A file of the folder `tmp_url` that did not fit is named where it was going: in `url`."""
    try:
        yield
    except NoSpaceError as exc:
        if not exc.path.startswith(tmp_url + "/"):
            raise
        raise NoSpaceError.at(url.rstrip("/") + exc.path[len(tmp_url):]) from exc


def _remove_dead_temporaries(fs: Any, root: str) -> None:
    """Once `root` is published, the `.tmp-NAME.HOST.PID` folders a killed process left beside it
    are this stack's own leftovers: remove those written on this host by a process that is gone
    (local filesystems only; one of another host, or without a host, stays)."""
    if not _local(fs):
        return
    parent, name = os.path.split(root)
    prefix = f".tmp-{name}."
    for leftover in Path(parent or ".").glob(f"{prefix}*"):
        host, _, pid = leftover.name[len(prefix):].rpartition(".")
        if host != socket.gethostname() or not pid.isdigit() or not leftover.is_dir() \
                or pid_alive(int(pid)):
            continue
        shutil.rmtree(leftover, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is alive (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _publish(fs: Any, tmp: str, root: str, url: str, made_here: Callable[[str], bool],
             last: str) -> None:
    old = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)} \
        if fs.isdir(root) else set()
    if _local(fs) and not old:  # new or empty: one rename
        if fs.exists(root):
            fs.rmdir(root)
        os.replace(tmp, root)
        return
    names = sorted((posixpath.basename(p.rstrip("/")) for p in fs.ls(tmp, detail=False)),
                   key=lambda name: name == last)  # `last` last
    taken = sorted(old.intersection(names))
    if taken and not made_here(url):
        raise FileExistsError(f"{url}: {taken[0]} exists and this stack did not write it; "
                              "nothing was written: give another output, or move it away")
    if last in old:
        fs.rm(posixpath.join(root, last))
    for name in names:
        _move(fs, posixpath.join(tmp, name), posixpath.join(root, name))
