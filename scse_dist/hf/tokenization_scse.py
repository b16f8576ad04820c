"""`ScseTokenizer`: the export's sentencepiece model (tokenizer.model) as a Hugging Face tokenizer
(remote code, see scse_dist/hf).

Encodes exactly as scse-dist's `Tokenizer` (scse_dist/data/tokenizer.py): sentencepiece's encode of
the whole text; strings like "</s>" in the text are text, not special tokens. The one addition,
with add_special_tokens=True (the default), is the EOS id in front: in scse-dist every document
and passage starts after an EOS, in training and in evaluation, so that is what a prompt starts
with. Nothing is appended. Decoding is sentencepiece's decode, so
`decode(encode(text, add_special_tokens=False)) == text` wherever scse-dist's round trip holds;
EOS decodes to "</s>" (sentencepiece's own decode drops it), or to nothing with
skip_special_tokens=True.
Padding is on the left (generation) with EOS as the pad token; the attention mask hides it.
"""

import os
import shutil
from typing import Optional

import sentencepiece as spm
from transformers import PreTrainedTokenizer


class ScseTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        # before super(): it reads the vocab
        self.sp_model = spm.SentencePieceProcessor(model_file=vocab_file)
        eos = self.sp_model.id_to_piece(self.sp_model.eos_id())
        kwargs.setdefault("eos_token", eos)
        kwargs.setdefault("bos_token", eos)  # documents start after an EOS (see the docstring)
        kwargs.setdefault("pad_token", eos)
        kwargs.setdefault("unk_token", self.sp_model.id_to_piece(self.sp_model.unk_id()))
        kwargs.setdefault("padding_side", "left")
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp_model.get_piece_size()

    def get_vocab(self) -> dict:
        return {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}

    # transformers' signatures of these differ between its versions (this file runs as remote
    # code under any of them); each override takes every argument its callers pass
    def tokenize(self, text: str, **kwargs) -> list:  # type: ignore[override]
        """sentencepiece's pieces of the whole text: no splitting at special-token strings."""
        return self.sp_model.encode(text, out_type=str)

    def _tokenize(self, text: str) -> list:  # type: ignore[override]
        return self.sp_model.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp_model.id_to_piece(int(index))

    def convert_tokens_to_string(self, tokens: list) -> str:
        return self.sp_model.decode_pieces(list(tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False,  # type: ignore[override]
                **kwargs) -> str:
        """sentencepiece's decode; a control token (EOS, the pad) is its piece, "</s>", unless
        skip_special_tokens drops it. (sentencepiece alone decodes EOS to "", and lm-eval's hf model
        takes a prefix token that decodes to "" as already present at the start of every text,
        which would drop the EOS in front of its contexts.)"""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            special = set(self.all_special_ids)
            ids = [i for i in ids if i not in special]
        text: list[str] = []
        run: list[int] = []
        for i in ids:
            if self.sp_model.is_control(i):
                text += [self.sp_model.decode(run), self.sp_model.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(text) + self.sp_model.decode(run)

    def build_inputs_with_special_tokens(self, token_ids_0: list,
                                         token_ids_1: Optional[list] = None) -> list:
        return [self.eos_token_id] + token_ids_0 + (token_ids_1 or [])

    def get_special_tokens_mask(self, token_ids_0: list, token_ids_1: Optional[list] = None,
                                already_has_special_tokens: bool = False) -> list:
        if already_has_special_tokens:
            return super().get_special_tokens_mask(token_ids_0, token_ids_1, True)
        return [1] + [0] * (len(token_ids_0) + len(token_ids_1 or []))

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None) -> tuple:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "")
                           + self.vocab_files_names["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
