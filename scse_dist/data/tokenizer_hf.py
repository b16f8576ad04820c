"""The "hf" tokenizer kind, a Hugging Face `tokenizers` JSON file (tokenizer.json), and training a
byte-level BPE into one (`scse-data tokenizer --kind byte-bpe`). A tokenizer.json names no EOS: the
first of EOS_NAMES in its vocabulary is the EOS, the first of BOS_NAMES the BOS (else the EOS);
a file with none is refused. Needs the `tokenizers` package.
"""

from __future__ import annotations

from typing import Any, Iterable

from scse_dist.atomic import write_file
from scse_dist.cli_errors import InputError
from scse_dist.data.extras import require_extra
from scse_dist.data.tokenizer_base import Sentences, Tokenizer
from scse_dist.typed_yaml import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
# The byte-level BPE trained here: the EOS first (id 0), the 256 bytes after the special tokens.
BYTE_BPE_EOS = "<|endoftext|>"


def require_tokenizers() -> Any:
    return require_extra("tokenizers", "tokenizers",
                         "a Hugging Face tokenizer (tokenizer.json, --kind byte-bpe)")


class HFTokenizer(Tokenizer):
    """A tokenizers JSON file, loaded; sha256 of its bytes."""

    kind = "hf"

    def __init__(self, data: bytes, path: str = "<bytes>"):
        tokenizers = require_tokenizers()
        super().__init__(data, path)
        try:
            self.tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # UnicodeDecodeError, or tokenizers' own (a plain Exception)
            raise InputError(f"tokenizer {path}: not a Hugging Face tokenizers JSON file: "
                             f"{str(exc).splitlines()[0][:200]}") from None
        # a special token's string in the text is text (as sentencepiece and tiktoken here)
        self.tok.encode_special_tokens = True
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        eos = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        if eos is None:
            raise InputError(f"tokenizer {path}: no end-of-text token (none of "
                             f"{', '.join(EOS_NAMES)}) to separate documents with")
        self.eos_id, self.eos_token = eos, self.tok.id_to_token(eos)
        self.bos_id = next((vocab[n] for n in BOS_NAMES if n in vocab), eos)
        self._batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        # tokenizers threads over the batch itself (RAYON_NUM_THREADS caps it)
        return [e.ids for e in self._batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def special_ids(self) -> dict[str, Any]:
        unk_token = getattr(self.tok.model, "unk_token", None)
        unk = self.tok.token_to_id(unk_token) if unk_token else None
        return {**super().special_ids(), **({"unk": unk} if unk is not None else {})}


def train_byte_bpe(texts: Iterable[str], vocab_size: int, out_path: str,
                   max_sentences: int = 2_000_000, special_tokens: Iterable[str] = (),
                   sample_fraction: float = 1.0) -> str:
    """Train a GPT-2-style byte-level BPE on `texts` (the lines of train_tokenizer) and write its
    tokenizer.json to `out_path`, which it returns. Ids: BYTE_BPE_EOS = 0, `special_tokens`, the
    256 bytes, the merges; every string encodes, and `decode(encode(s)) == s`."""
    tokenizers = require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    sentences = Sentences(texts, max_sentences, sample_fraction)
    specials = [BYTE_BPE_EOS, *[t for t in special_tokens if t != BYTE_BPE_EOS]]
    if vocab_size < 256 + len(specials):
        raise ConfigError(f"vocab_size: {vocab_size} is too small for a byte-level BPE: 256 byte "
                          f"tokens plus {len(specials)} special, so use at least "
                          f"{256 + len(specials)}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    try:
        tok.train_from_iterator(iter(sentences), trainer)
    except Exception:
        sentences.check()
        raise
    sentences.check()
    write_file(out_path, tok.to_str().encode("utf-8"))  # whole or not at all (scse_dist.atomic)
    return out_path
