"""SentencePiece tokenizer: train from a text stream, load from any fsspec URL, hash.

Conventions every shard and model in the project relies on: unk = 0, bos = 1, eos = 2, no pad
id (packing never pads). Byte fallback is on by default, so every string encodes without
`<unk>`, and the normaliser is the identity, so `decode(encode(s)) == s` for ordinary text
(whitespace and case are kept; sentencepiece only drops a leading space it added itself).
"""

from __future__ import annotations

import hashlib
import io
from typing import Iterable, Iterator

import fsspec
import sentencepiece as spm

from scse_dist.cli_errors import InputError
from scse_dist.config import ConfigError

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# sentencepiece skips training sentences longer than this many bytes; we cut lines to fit.
MAX_SENTENCE_BYTES = 4096


def _training_lines(texts: Iterable[str], max_sentences: int, sample_fraction: float = 1.0
                    ) -> Iterator[str]:
    """Documents -> non-empty lines (sentencepiece's unit), the first `max_sentences` of them.

    `sample_fraction` < 1 keeps a document when a hash of its text falls below it: a sample
    spread over the whole of a large corpus, taken while streaming, and the same on every run
    (unlike sentencepiece's own random sampling, which needs the corpus in memory).
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


class _Sentences:
    """The training lines, counted, remembering an error raised while reading them: sentencepiece
    turns an iterator's exception into a RuntimeError, which would hide e.g. an InputError."""

    error: Exception | None

    def __init__(self, lines: Iterator[str]):
        self.lines, self.count, self.error = lines, 0, None

    def __iter__(self) -> Iterator[str]:
        try:
            for line in self.lines:
                self.count += 1
                yield line
        except Exception as exc:
            self.error = exc
            raise


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str, model_type: str = "bpe",
                    byte_fallback: bool = True, max_sentences: int = 2_000_000,
                    num_threads: int = 2, special_tokens: Iterable[str] = (),
                    sample_fraction: float = 1.0) -> str:
    """Train a sentencepiece model on `texts` (streamed) and write it to `out_path` (fsspec URL).

    Returns `out_path`. `max_sentences` caps the number of lines read (the first ones);
    `sample_fraction` samples documents first (see _training_lines). `special_tokens` become
    single pieces that are never split (e.g. `<|endoftext|>`, `<pad>`), right after unk/bos/eos.
    """
    if not 0.0 < sample_fraction <= 1.0:
        raise ConfigError(f"sample_fraction: must lie in (0, 1], got {sample_fraction}")
    if vocab_size < 260 and byte_fallback:
        raise ConfigError(f"vocab_size: {vocab_size} is too small; byte_fallback needs 256 byte "
                         "pieces plus unk/bos/eos, so use at least 260")
    model = io.BytesIO()
    sentences = _Sentences(_training_lines(texts, max_sentences, sample_fraction))
    spm.set_random_generator_seed(0)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            user_defined_symbols=list(special_tokens),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=byte_fallback,
            character_coverage=0.9995 if byte_fallback else 1.0,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            shuffle_input_sentence=False,
            max_sentence_length=MAX_SENTENCE_BYTES,
            # Small corpora cannot always fill the vocabulary; stop short instead of failing.
            hard_vocab_limit=False,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError:
        if sentences.error is not None:
            raise sentences.error from None
        if sentences.count == 0:
            raise InputError("no text to train a tokenizer on (the documents hold no non-blank "
                             "line)") from None
        raise
    with fsspec.open(out_path, "wb", auto_mkdir=True) as f:
        f.write(model.getvalue())
    return out_path


class Tokenizer:
    """A loaded sentencepiece model plus the sha256 of its bytes (shards record it)."""

    def __init__(self, model_bytes: bytes, path: str = "<bytes>"):
        self.path, self.model_bytes = path, model_bytes
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:  # sentencepiece's only error for bytes that are not a model
            raise InputError(f"tokenizer {path}: not a sentencepiece model ({len(model_bytes)} "
                             "bytes that do not parse); train one with `scse-data "
                             "tokenizer`") from None
        if self.sp.eos_id() < 0:
            raise InputError(f"tokenizer {path}: has no eos id; train it with `scse-data "
                             "tokenizer`")

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        try:
            with fsspec.open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer model {path!r} does not exist "
                                    "(train one with `scse-data tokenizer`)") from None
        except IsADirectoryError:
            raise IsADirectoryError(f"tokenizer model {path!r} is a directory, not a .model "
                                    "file") from None
        except Exception as exc:  # only fsspec runs here: unknown protocol, no backend, network
            raise OSError(f"tokenizer model {path!r} cannot be read: "
                          f"{type(exc).__name__}: {exc}") from exc
        return cls(data, path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        """Encode many texts at once (sentencepiece threads over them; 0 = all cores)."""
        return self.sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
