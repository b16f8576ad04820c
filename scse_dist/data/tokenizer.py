"""Tokenizers (docs/data.md, "Tokenizers"): `Tokenizer.load(path, kind="auto")` gives a
SentencePieceTokenizer, HFTokenizer or TiktokenTokenizer, each with `encode` (nothing added; a
special token's string is text), `encode_batch`, `decode` (special tokens dropped), `vocab_size`,
`eos_id` (the document separator), `bos_id` (nothing adds it), `sha256` and `export_files()`.
The sentencepiece models trained here: unk 0, bos 1, eos 2, no pad (packing never pads), byte
fallback (no `<unk>`) and the identity normaliser, so `decode(encode(s)) == s`.
"""

from __future__ import annotations

import io
from typing import Any, Iterable

import sentencepiece as spm

from scse_dist.atomic import write_file
from scse_dist.cli_errors import InputError
from scse_dist.data.tokenizer_base import (  # noqa: F401  (re-exported: the package's names)
    MAX_SENTENCE_BYTES,
    Sentences,
    Tokenizer,
    detect_kind,
    read_tokenizer_file,
    training_lines,
)
from scse_dist.typed_yaml import ConfigError

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str, model_type: str = "bpe",
                    byte_fallback: bool = True, max_sentences: int = 2_000_000,
                    num_threads: int = 2, special_tokens: Iterable[str] = (),
                    sample_fraction: float = 1.0) -> str:
    """Train a sentencepiece model on the first `max_sentences` lines of `texts` (training_lines)
    and write it to `out_path` (fsspec URL), which it returns. `special_tokens` become pieces
    never split (e.g. `<|endoftext|>`), right after unk/bos/eos."""
    sentences = Sentences(texts, max_sentences, sample_fraction)
    if vocab_size < 260 and byte_fallback:
        raise ConfigError(f"vocab_size: {vocab_size} is too small; byte_fallback needs 256 byte "
                         "pieces plus unk/bos/eos, so use at least 260")
    model = io.BytesIO()
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
    except RuntimeError:  # sentencepiece's wrapping of whatever went wrong
        sentences.check()
        raise
    write_file(out_path, model.getvalue())  # whole or not at all (scse_dist.atomic)
    return out_path


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model plus the sha256 of its bytes (shards record it)."""

    kind = "sentencepiece"

    def __init__(self, model_bytes: bytes, path: str = "<bytes>"):
        super().__init__(model_bytes, path)
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError:  # sentencepiece's only error for bytes that are not a model
            raise InputError(f"tokenizer {path}: not a sentencepiece model ({len(model_bytes)} "
                             "bytes that do not parse), nor a tokenizer.json or tiktoken ranks "
                             "file; train one with `scse-data tokenizer`") from None
        if self.sp.eos_id() < 0:
            raise InputError(f"tokenizer {path}: has no eos id; train it with `scse-data "
                             "tokenizer`")
        sp = self.sp
        self.vocab_size, self.eos_id, self.bos_id = sp.get_piece_size(), sp.eos_id(), sp.bos_id()
        self.eos_token = sp.id_to_piece(self.eos_id)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def special_ids(self) -> dict[str, Any]:
        return {**super().special_ids(), "unk": self.sp.unk_id()}


def _load_hf(data: bytes, path: str) -> Tokenizer:
    from scse_dist.data.tokenizer_hf import HFTokenizer

    return HFTokenizer(data, path)


def _load_tiktoken(data: bytes, path: str) -> Tokenizer:
    from scse_dist.data.tokenizer_tiktoken import TiktokenTokenizer

    return TiktokenTokenizer.from_file(data, path)


Tokenizer.loaders.update(sentencepiece=SentencePieceTokenizer, hf=_load_hf,
                         tiktoken=_load_tiktoken)
