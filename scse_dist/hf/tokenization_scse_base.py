"""`ScseTokenizerBase`: what the slow tokenizers of an export share (remote code, see scse_dist/hf).

In scse-dist every document and prompt starts after an EOS, so with add_special_tokens=True (the
default) the EOS id goes in front and nothing after; EOS is also the BOS and the pad; padding is
on the left (generation). A special token's string in the text is text.
"""

import os
import shutil
from typing import Optional

from transformers import PreTrainedTokenizer


class ScseTokenizerBase(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, eos: str, /, **kwargs):
        for name in ("eos_token", "bos_token", "pad_token"):
            kwargs.setdefault(name, eos)
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    # transformers' signatures of these differ between its versions (this file runs as remote
    # code under any of them); each override takes every argument its callers pass
    def _tokenize(self, text: str) -> list:  # type: ignore[override]
        return self.tokenize(text)

    def _decode_runs(self, token_ids, is_special, decode, keep_special: bool,
                     dropped: frozenset = frozenset()) -> str:
        """`decode` of each run of ids between special ones (`is_special`), the special ones as
        their token strings (if keep_special); ids in `dropped` are left out first."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text: list[str] = []
        run: list[int] = []
        for i in (i for i in ids if i not in dropped):
            if is_special(i):
                text += [decode(run), self._convert_id_to_token(i)] if keep_special \
                    else [decode(run)]
                run = []
            else:
                run.append(i)
        return "".join(text) + decode(run)

    def build_inputs_with_special_tokens(self, token_ids_0: list,
                                         token_ids_1: Optional[list] = None) -> list:
        return [self.eos_token_id] + token_ids_0 + (token_ids_1 or [])

    def get_special_tokens_mask(self, token_ids_0: list, token_ids_1: Optional[list] = None,
                                already_has_special_tokens: bool = False) -> list:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, True)
        return [1] + [0] * (len(token_ids_0) + len(token_ids_1 or []))

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> tuple:
        """Copies each of vocab_files_names' files (kept as the attribute of its key)."""
        out = []
        for key, name in self.vocab_files_names.items():
            source = getattr(self, key)
            path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "")
                                + name)
            if os.path.abspath(source) != os.path.abspath(path):
                shutil.copyfile(source, path)
            out.append(path)
        return tuple(out)
