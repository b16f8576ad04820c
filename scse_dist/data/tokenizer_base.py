"""The tokenizer interface every kind implements (scse_dist.data.tokenizer, which registers the
kinds' loaders, documents it), reading a tokenizer file, and the lines every trainer reads.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, ClassVar, Iterable, Iterator

import fsspec

from scse_dist.cli_errors import InputError
from scse_dist.data.config import (
    TOKENIZER_EXPORT_NAMES as EXPORT_NAMES,
    TOKENIZER_KINDS as KINDS,
    TokenizerKind,
)
from scse_dist.typed_yaml import ConfigError

# sentencepiece skips training sentences longer than this many bytes; we cut lines to fit.
MAX_SENTENCE_BYTES = 4096


def training_lines(texts: Iterable[str], max_sentences: int, sample_fraction: float = 1.0
                   ) -> Iterator[str]:
    """Documents -> non-empty lines (sentencepiece's unit), the first `max_sentences` of them.
    `sample_fraction` < 1 keeps a document whose text hashes below it: spread over the corpus,
    streamed and the same on every run (sentencepiece's own sampling holds the corpus in memory).
    """
    count = 0
    for text in texts:
        if sample_fraction < 1.0:
            digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
            if int.from_bytes(digest, "big") / 2**64 >= sample_fraction:
                continue
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            # Cut by characters well under the byte limit (UTF-8 is at most 4 bytes a char).
            yield line[: MAX_SENTENCE_BYTES // 4]
            count += 1
            if count >= max_sentences:
                return


class Sentences:
    """A trainer's lines (training_lines), counted, remembering an error raised while reading
    them: the trainers wrap an iterator's exception, which would hide e.g. an InputError."""

    error: Exception | None

    def __init__(self, texts: Iterable[str], max_sentences: int, sample_fraction: float):
        if not 0.0 < sample_fraction <= 1.0:
            raise ConfigError(f"sample_fraction: must lie in (0, 1], got {sample_fraction}")
        self.lines = training_lines(texts, max_sentences, sample_fraction)
        self.count, self.error = 0, None

    def __iter__(self) -> Iterator[str]:
        try:
            for line in self.lines:
                self.count += 1
                yield line
        except Exception as exc:
            self.error = exc
            raise

    def check(self) -> None:
        """After the trainer failed or ended: the reader's own error, or none read at all."""
        if self.error is not None:
            raise self.error from None
        if self.count == 0:
            raise InputError("no text to train a tokenizer on (the documents hold no non-blank "
                             "line)")


class Tokenizer:
    """The interface (see the module docstring); `Tokenizer.load` returns the kind's subclass."""

    kind: TokenizerKind
    path: str
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int
    eos_token: str  # the EOS's string (the Hugging Face files name it)

    # kind -> (bytes, path) -> Tokenizer; scse_dist.data.tokenizer fills it (importing each
    # kind's module only when one is loaded), so the kinds' modules import only this one.
    loaders: ClassVar[dict[str, Callable[[bytes, str], "Tokenizer"]]] = {}

    def __init__(self, data: bytes, path: str):
        self.data, self.path = data, path
        self.sha256 = hashlib.sha256(data).hexdigest()

    def __reduce__(self):  # tokenizer worker processes get the file's bytes, not the object
        return type(self), (self.data, self.path)

    @staticmethod
    def load(path: str, kind: str = "auto") -> "Tokenizer":
        """The tokenizer file at `path` (a path or fsspec URL); kind "auto" tells it by content."""
        if kind not in ("auto", *KINDS):
            raise InputError(f"tokenizer kind {kind!r}: expected auto or one of {', '.join(KINDS)}")
        data = read_tokenizer_file(path)
        return Tokenizer.loaders[detect_kind(data) if kind == "auto" else kind](data, path)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Encode many texts at once (threads over them where the kind can; 0 = all cores)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def export_files(self) -> dict[str, bytes]:
        """{file name: bytes} an export writes so that Tokenizer.load(its first name) gives this
        tokenizer again (the same ids and sha256)."""
        return {EXPORT_NAMES[self.kind]: self.data}

    def special_ids(self) -> dict[str, Any]:
        """What the Hugging Face files name: the ids eos, bos, unk (where the kind has one) and
        the eos_token string."""
        return {"eos": self.eos_id, "bos": self.bos_id, "eos_token": self.eos_token}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, "
                f"sha256={self.sha256[:12]})")


def read_tokenizer_file(path: str) -> bytes:
    """The bytes at `path` (fsspec), each failure one line naming the file."""
    try:
        with fsspec.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer model {path!r} does not exist "
                                "(train one with `scse-data tokenizer`)") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"tokenizer model {path!r} is a directory, not a tokenizer "
                                "file (.model, tokenizer.json or .tiktoken)") from None
    except Exception as exc:  # only fsspec runs here: unknown protocol, no backend, network
        raise OSError(f"tokenizer model {path!r} cannot be read: "
                      f"{type(exc).__name__}: {exc}") from exc


_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+")


def detect_kind(data: bytes) -> str:
    """"hf" for JSON, "tiktoken" for `base64 rank` lines, else "sentencepiece" (to be parsed)."""
    if data.lstrip()[:1] == b"{":
        return "hf"
    first = data.split(b"\n", 1)[0].rstrip(b"\r")
    return "tiktoken" if _TIKTOKEN_LINE.fullmatch(first) else "sentencepiece"
