"""`ScseTokenizer`: the export's sentencepiece model (tokenizer.model) as a Hugging Face tokenizer
(remote code, see scse_dist/hf): sentencepiece's encode of the whole text, as scse-dist's
`Tokenizer`, plus the EOS in front (tokenization_scse_base.py); EOS decodes to "</s>" (to
nothing with skip_special_tokens=True).
"""

import sentencepiece as spm

from .tokenization_scse_base import ScseTokenizerBase


class ScseTokenizer(ScseTokenizerBase):
    vocab_files_names = {"vocab_file": "tokenizer.model"}

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        # before super(): it reads the vocab
        self.sp_model = spm.SentencePieceProcessor(model_file=vocab_file)
        kwargs.setdefault("unk_token", self.sp_model.id_to_piece(self.sp_model.unk_id()))
        super().__init__(self.sp_model.id_to_piece(self.sp_model.eos_id()), **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp_model.get_piece_size()

    def get_vocab(self) -> dict:
        return {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}

    def tokenize(self, text: str, **kwargs) -> list:  # type: ignore[override]
        """sentencepiece's pieces of the whole text: no splitting at special-token strings."""
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
        skip_special_tokens drops it. (lm-eval's hf model takes a prefix token that decodes to ""
        as already present at the start of every text, which would drop the EOS in front.)"""
        dropped = frozenset(self.all_special_ids if skip_special_tokens else ())
        return self._decode_runs(token_ids, self.sp_model.is_control, self.sp_model.decode, True,
                                 dropped)
