"""The "tiktoken" tokenizer kind: a tiktoken BPE ranks file (`NAME.tiktoken`) from a path or
fsspec URL, never the network, with its pattern and special tokens in `NAME.tiktoken.json`
(SETTINGS_SUFFIX; docs/data.md) or, without it, those tiktoken defines for NAME (cl100k_base, ...).
The sha256 covers ranks and settings; an export writes both. Needs the `tiktoken` package.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from typing import Any, Optional

from scse_dist.cli_errors import InputError
from scse_dist.data.config import TOKENIZER_EXPORT_NAMES as EXPORT_NAMES
from scse_dist.data.extras import require_extra
from scse_dist.data.tokenizer_base import Tokenizer, read_tokenizer_file

SETTINGS_SUFFIX = ".json"
ENDOFTEXT = "<|endoftext|>"


def require_tiktoken() -> Any:
    return require_extra("tiktoken", "tiktoken", "a tiktoken tokenizer (a .tiktoken ranks file)")


def parse_ranks(data: bytes, path: str) -> dict[bytes, int]:
    """The `base64 rank` lines of a ranks file -> {token bytes: rank} (InputError naming a line)."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise InputError(f"tokenizer {path}:{n}: not a `base64-token rank` line of a tiktoken "
                             "ranks file") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken encodes any text from single bytes up; without them it cannot
        raise InputError(f"tokenizer {path}: the ranks lack {len(missing)} of the 256 single-byte "
                         f"tokens (e.g. byte {missing[0]}), so not every text encodes")
    return ranks


def openai_settings(name: str, ranks: dict[bytes, int]) -> Optional[dict]:
    """The pattern and special tokens tiktoken defines for the encoding `name`, None if it defines
    none by that name. Its constructors load their ranks from the network, so their loaders are
    swapped for ones returning `ranks` (already read) while the constructor runs."""
    require_tiktoken()
    import tiktoken_ext.openai_public as public

    constructor = public.ENCODING_CONSTRUCTORS.get(name)
    if constructor is None:
        return None
    saved = public.load_tiktoken_bpe, public.data_gym_to_mergeable_bpe_ranks
    public.load_tiktoken_bpe = public.data_gym_to_mergeable_bpe_ranks = lambda *a, **k: ranks
    try:
        spec = constructor()
    finally:
        public.load_tiktoken_bpe, public.data_gym_to_mergeable_bpe_ranks = saved
    return {"pat_str": spec["pat_str"], "special_tokens": dict(spec["special_tokens"]),
            "eos_token": ENDOFTEXT, "bos_token": ENDOFTEXT}


def check_settings(settings: Any, where: str) -> dict:
    """The settings with defaults filled in; InputError naming the bad key."""
    if not isinstance(settings, dict) or not isinstance(settings.get("pat_str"), str):
        raise InputError(f"{where}: expected a JSON object with a string 'pat_str' (the "
                         "pre-tokenizer regex) and 'special_tokens' {token: id}")
    special = settings.get("special_tokens", {})
    if not isinstance(special, dict) or not all(isinstance(k, str) and isinstance(v, int)
                                                for k, v in special.items()):
        raise InputError(f"{where}: 'special_tokens' must map token strings to integer ids")
    eos = settings.get("eos_token", ENDOFTEXT)
    bos = settings.get("bos_token", eos)
    for key, token in (("eos_token", eos), ("bos_token", bos)):
        if token not in special:
            raise InputError(f"{where}: {key} {token!r} is not one of the special_tokens "
                             f"{sorted(special)}")
    return {"pat_str": settings["pat_str"], "special_tokens": special, "eos_token": eos,
            "bos_token": bos}


class TiktokenTokenizer(Tokenizer):
    """A tiktoken Encoding from a ranks file and its settings (see the module docstring)."""

    kind = "tiktoken"

    def __init__(self, ranks_data: bytes, settings: dict, path: str = "<bytes>"):
        tiktoken = require_tiktoken()
        self.path, self.data = path, ranks_data
        self.settings = check_settings(settings, f"tokenizer {path} settings")
        ranks = parse_ranks(ranks_data, path)
        special = self.settings["special_tokens"]
        clash = sorted(set(special.values()) & set(ranks.values()))
        if clash:
            raise InputError(f"tokenizer {path}: special token ids {clash[:5]} are also ranks")
        try:
            self.enc = tiktoken.Encoding(name=os.path.basename(path),
                                         pat_str=self.settings["pat_str"],
                                         mergeable_ranks=ranks, special_tokens=special)
        except ValueError as exc:  # a pattern that does not compile
            raise InputError(f"tokenizer {path}: tiktoken refuses it: {exc}") from None
        self.sha256 = hashlib.sha256(ranks_data + b"\n" + self.settings_bytes()).hexdigest()
        self.vocab_size = max([*ranks.values(), *special.values()]) + 1
        self.eos_token = self.settings["eos_token"]
        self.eos_id, self.bos_id = special[self.eos_token], special[self.settings["bos_token"]]
        self._special = set(special.values())

    @classmethod
    def from_file(cls, data: bytes, path: str) -> "TiktokenTokenizer":
        """`path`'s ranks with the settings beside it, or those of the encoding it is named for."""
        try:
            raw = read_tokenizer_file(path + SETTINGS_SUFFIX)
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                settings = json.loads(raw)
            except ValueError as exc:
                raise InputError(f"tokenizer settings {path + SETTINGS_SUFFIX}: not JSON: "
                                 f"{exc}") from None
            return cls(data, check_settings(settings, f"{path}{SETTINGS_SUFFIX}"), path)
        name = os.path.basename(path).split(".")[0]
        known = openai_settings(name, parse_ranks(data, path))
        if known is None:
            raise InputError(f"tokenizer {path}: a tiktoken ranks file, but its pattern and "
                             f"special tokens are not stated: write {path + SETTINGS_SUFFIX} "
                             "({\"pat_str\": ..., \"special_tokens\": {...}}) or name the file "
                             "after a tiktoken encoding (cl100k_base.tiktoken, ...)")
        return cls(data, known, path)

    def __reduce__(self):
        return type(self), (self.data, self.settings, self.path)

    def settings_bytes(self) -> bytes:
        return (json.dumps(self.settings, indent=2, sort_keys=True) + "\n").encode("utf-8")

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)  # special tokens' strings are text

    def encode_batch(self, texts: list[str], num_threads: int = 0) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads or os.cpu_count()
                                              or 1)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) not in self._special])

    def export_files(self) -> dict[str, bytes]:
        name = EXPORT_NAMES[self.kind]
        return {name: self.data, name + SETTINGS_SUFFIX: self.settings_bytes()}
