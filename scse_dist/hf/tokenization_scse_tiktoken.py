"""`ScseTiktokenTokenizer`: the export's tiktoken ranks (tokenizer.tiktoken) and settings
(tokenizer.tiktoken.json: pattern, special tokens, EOS; data.tokenizer_kind "tiktoken") as a
transformers tokenizer (remote code, see scse_dist/hf). Needs the `tiktoken` package.

Encodes exactly as scse-dist's "tiktoken" kind (scse_dist/data/tokenizer_tiktoken.py): tiktoken's
encode_ordinary, so a special token's string in the text is text. With add_special_tokens=True
(the default) the EOS id goes in front, as ScseTokenizer does. A token's string is its bytes in
GPT-2's byte-to-unicode alphabet (tiktoken's tokens need not be UTF-8); decoding joins the bytes
and decodes them as UTF-8 (invalid bytes replaced, as tiktoken does); a special token decodes to
its string unless skip_special_tokens. EOS is also the BOS and the pad; padding is on the left.
"""

import base64
import json
import os
import shutil
from typing import Optional

import tiktoken
from transformers import PreTrainedTokenizer


def _byte_alphabet() -> dict:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class ScseTiktokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.tiktoken",
                         "settings_file": "tokenizer.tiktoken.json"}
    model_input_names = ["input_ids", "attention_mask"]

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
        self.byte_of = {c: b for b, c in alphabet.items()}
        self.encoder = {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}
        self.encoder.update(special)
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.special_id_set = set(special.values())
        eos = settings["eos_token"]
        kwargs.setdefault("eos_token", eos)
        kwargs.setdefault("bos_token", eos)  # documents start after an EOS
        kwargs.setdefault("pad_token", eos)
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return max(self.decoder) + 1

    def get_vocab(self) -> dict:
        return dict(self.encoder)

    # transformers' signatures of these differ between its versions (this file runs as remote
    # code under any of them); each override takes every argument its callers pass
    def tokenize(self, text: str, **kwargs) -> list:  # type: ignore[override]
        """tiktoken's tokens of the whole text: no splitting at special-token strings."""
        return [self.decoder[i] for i in self.enc.encode_ordinary(text)]

    def _tokenize(self, text: str) -> list:  # type: ignore[override]
        return self.tokenize(text)

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

    def build_inputs_with_special_tokens(self, token_ids_0: list,
                                         token_ids_1: Optional[list] = None) -> list:
        return [self.eos_token_id] + token_ids_0 + (token_ids_1 or [])

    def get_special_tokens_mask(self, token_ids_0: list, token_ids_1: Optional[list] = None,
                                already_has_special_tokens: bool = False) -> list:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, True)
        return [1] + [0] * (len(token_ids_0) + len(token_ids_1 or []))

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> tuple:
        out = []
        for key, source in (("vocab_file", self.vocab_file),
                            ("settings_file", self.settings_file)):
            path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "")
                                + self.vocab_files_names[key])
            if os.path.abspath(source) != os.path.abspath(path):
                shutil.copyfile(source, path)
            out.append(path)
        return tuple(out)
