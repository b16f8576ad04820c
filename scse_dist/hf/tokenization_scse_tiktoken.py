"""`ScseTiktokenTokenizer`: the export's tiktoken ranks (tokenizer.tiktoken) and settings
(tokenizer.tiktoken.json) as a transformers tokenizer (remote code, see scse_dist/hf): tiktoken's
encode_ordinary, as scse-dist's "tiktoken" kind, plus the EOS in front (tokenization_scse_base.py).
A token's string is its bytes in GPT-2's byte-to-unicode alphabet; decoding joins the bytes as
UTF-8 (invalid bytes replaced, as tiktoken does).
"""

import base64
import json

import tiktoken

from .tokenization_scse_base import ScseTokenizerBase


def _byte_alphabet() -> dict:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class ScseTiktokenTokenizer(ScseTokenizerBase):
    vocab_files_names = {"vocab_file": "tokenizer.tiktoken",
                         "settings_file": "tokenizer.tiktoken.json"}

    def __init__(self, vocab_file: str, settings_file: str, **kwargs):
        self.vocab_file, self.settings_file = vocab_file, settings_file
        with open(settings_file, encoding="utf-8") as f:
            settings = json.load(f)
        ranks = {}
        with open(vocab_file, "rb") as f:
            for line in f.read().splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        special = settings["special_tokens"]
        # before super(): it reads the vocab
        self.enc = tiktoken.Encoding(name="scse", pat_str=settings["pat_str"],
                                     mergeable_ranks=ranks, special_tokens=special)
        alphabet = _byte_alphabet()
        self.encoder = {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}
        self.encoder.update(special)
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.special_id_set = set(special.values())
        super().__init__(settings["eos_token"], **kwargs)

    @property
    def vocab_size(self) -> int:
        return max(self.decoder) + 1

    def get_vocab(self) -> dict:
        return dict(self.encoder)

    def tokenize(self, text: str, **kwargs) -> list:  # type: ignore[override]
        """tiktoken's tokens of the whole text: no splitting at special-token strings."""
        return [self.decoder[i] for i in self.enc.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[int(index)]

    def convert_tokens_to_string(self, tokens: list) -> str:
        return self._decode([self.encoder[t] for t in tokens])

    def _decode(self, token_ids, skip_special_tokens: bool = False,  # type: ignore[override]
                **kwargs) -> str:
        """A special token is its string unless skip_special_tokens."""
        return self._decode_runs(token_ids, self.special_id_set.__contains__, self.enc.decode,
                                 not skip_special_tokens)
