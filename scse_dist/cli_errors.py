"""Bad input at a command: one line on stderr naming the file and the fix, and an exit status a
pipeline can act on, never a traceback (docs/config.md, "Bad input and exit statuses"). Every
console script's `main` is wrapped in `cli_main(prog)`; scse-train adds 3, 4 and 75.

    2    bad arguments or config (argparse's own status; ConfigError)
    65   bad input data (InputError; sysexits' EX_DATAERR)
    66   an input that is missing or cannot be read (OSError; sysexits' EX_NOINPUT)
    74   no space left writing an output: a full disk, a quota or a file-size limit (NoSpaceError,
         or an OSError with ENOSPC, EDQUOT or EFBIG; sysexits' EX_IOERR). The line names the path
         and the free space; nothing partial is left in place of an output
    75   try again later: another process holds what the command would write (TryLater;
         sysexits' EX_TEMPFAIL, the status a launcher requeues)
    130  Ctrl-C: one line, `<prog>: interrupted` (a command that kept partial work raises
         `Interrupted("what was kept")` and the line says so)

A reader of stdout that goes away early (`| head`) ends the command silently with status 0.
Anything else (a bug) still ends in a traceback. `command_parser(prog, __doc__)` gives `--help`
the module docstring: its first paragraph as the description, the rest below the options.
"""

from __future__ import annotations

import argparse
import functools
import glob
import io
import json
import os
import select
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

from scse_dist.atomic import NO_SPACE_ERRNOS, NoSpaceError
from scse_dist.typed_yaml import ConfigError

EXIT_CONFIG = 2
EXIT_BAD_INPUT = 65
EXIT_NO_INPUT = 66
EXIT_NO_SPACE = 74
EXIT_TEMPFAIL = 75
EXIT_INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, after the command kept what it could; the message says what (one line)."""


class TryLater(Exception):
    """Another process holds what this command would write (a run dir's lock); the message names
    it. Exit 75: rerun when it has ended."""


class InputError(ValueError):
    """Input data a user can fix. The message names the file (file:line where there is one) and
    says what is wrong and what to do. A ValueError, so library callers may catch either."""


def doc_help(doc: str) -> dict:
    """A parser's (or sub-parser's) help from `doc`: its first paragraph as the description, the
    rest (usage examples, defaults) as the epilog, both as written."""
    first, _, rest = doc.strip().partition("\n\n")
    return dict(description=first, epilog=rest or None,
                formatter_class=argparse.RawDescriptionHelpFormatter)


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser whose help shows `doc` (doc_help)."""
    return argparse.ArgumentParser(prog=prog, **doc_help(doc))


def exit_status(exc: BaseException) -> Optional[int]:
    """The exit status of an error bad input causes; None for anything else (a bug: re-raise)."""
    if isinstance(exc, TryLater):
        return EXIT_TEMPFAIL
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    # UnicodeDecodeError and JSONDecodeError are ValueErrors too; readers normally convert them to
    # InputError with the file named, these are the fallback for a reader that did not.
    if isinstance(exc, (InputError, UnicodeDecodeError, json.JSONDecodeError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, NoSpaceError) or \
            (isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS):
        return EXIT_NO_SPACE
    # io.UnsupportedOperation is an OSError, but that one is a bug
    if isinstance(exc, OSError) and not isinstance(exc, io.UnsupportedOperation):
        return EXIT_NO_INPUT
    return None


def one_line(exc: BaseException) -> str:
    """The error's message on one line (some libraries' messages span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return text


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader left (`| head`): poll says POLLERR. stdout then goes
    to /dev/null, or the interpreter's last flush at exit would report the broken pipe after all.
    A broken pipe elsewhere (a socket, a child's stdin) is an error like any other."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    except (OSError, ValueError, AttributeError):  # no file descriptor, no poll (Windows)
        return False
    return True


@contextmanager
def from_config(field: str, value: str, source: str, flag: str) -> Iterator[None]:
    """Reading `value`, `field` of `source`'s config rather than a flag the user gave: a missing
    local path, and any bad input met inside, say where the path came from and which flag names
    another."""
    where = f"{field} of the config of {source}; {flag} names another"
    local = "://" not in value and "{" not in value
    if local and not os.path.exists(value) and not glob.glob(value):
        raise FileNotFoundError(f"{value!r} does not exist here ({os.getcwd()}): it is {where}")
    try:
        yield
    except Exception as exc:
        status = exit_status(exc)
        if status not in (EXIT_BAD_INPUT, EXIT_NO_INPUT):
            raise
        kind = InputError if status == EXIT_BAD_INPUT else OSError
        raise kind(f"{one_line(exc)} ({value!r} is {where})") from None


def cli_main(prog: str) -> Callable:
    """Decorator for a console script's `main(argv) -> int`: bad input -> one line + exit status."""

    def wrap(main: Callable[[Optional[Sequence[str]]], int]) -> Callable:
        @functools.wraps(main)
        def run(argv: Optional[Sequence[str]] = None) -> int:
            try:
                done = main(argv)
                sys.stdout.flush()  # a closed pipe shows here when the output fit its buffer
                return done
            except KeyboardInterrupt as exc:
                note = f": {one_line(exc)}" if str(exc) else ""
                print(f"\n{prog}: interrupted{note}", file=sys.stderr, flush=True)
                return EXIT_INTERRUPTED
            except Exception as exc:
                if isinstance(exc, BrokenPipeError) and _stdout_gone():
                    return 0
                status = exit_status(exc)
                if status is None:
                    raise
                if status == EXIT_NO_SPACE and not isinstance(exc, NoSpaceError) and \
                        isinstance(exc, OSError) and exc.filename:  # the free space named too
                    exc = NoSpaceError.at(exc.filename)
                kind = {EXIT_CONFIG: "config error: ", EXIT_NO_SPACE: "",
                        EXIT_TEMPFAIL: "busy: "}.get(status, "error: ")
                print(f"{prog}: {kind}{one_line(exc)}", file=sys.stderr, flush=True)
                return status

        return run

    return wrap
