"""`ScseTiktokenTokenizer`: the export's tiktoken ranks (tokenizer.tiktoken) and settings
(tokenizer.tiktoken.json: pattern, special tokens, EOS; data.tokenizer_kind "tiktoken") as a
transformers tokenizer (remote code, see scse_dist/hf). Needs the `tiktoken` package.

Encodes exactly as scse-dist's "tiktoken" kind (scse_dist/data/tokenizer_tiktoken.py): tiktoken's
encode_ordinary, plus the EOS in front (tokenization_scse_base.py). A token's string is its bytes
in GPT-2's byte-to-unicode alphabet (tiktoken's tokens need not be UTF-8); decoding joins the bytes
and decodes them as UTF-8 (invalid bytes replaced, as tiktoken does); a special token decodes to
its string unless skip_special_tokens.
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
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text: list = []
        run: list = []
        for i in ids:
            if i in self.special_id_set:
                text.append(self.enc.decode(run))
                run = []
                if not skip_special_tokens:
                    text.append(self.decoder[i])
            else:
                run.append(i)
        return "".join(text) + self.enc.decode(run)
