"""`ScseTokenizerFast`: the export's tokenizer.json (data.tokenizer_kind "hf") as a transformers
tokenizer (remote code, see scse_dist/hf): the file's pipeline, a special token's string kept as
text, and the EOS in front as the slow tokenizers do, replacing the file's own post-processor.
"""

from tokenizers import processors
from transformers import PreTrainedTokenizerFast


class ScseTokenizerFast(PreTrainedTokenizerFast):
    # No __init__: transformers 5 loads tokenizer.json as it is only into a class without one
    # (it rebuilds one with its own __init__ from the bare vocab and merges, which drops the
    # pre-tokenizer). tokenizer_config.json gives padding_side, split_special_tokens and the EOS.
    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    slow_tokenizer_class = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        tokenizer = super().from_pretrained(*args, **kwargs)
        tokenizer.update_post_processor()  # 4.57 does not call it itself
        return tokenizer

    def update_post_processor(self):
        """EOS in front, nothing after (transformers 5 calls this whenever the special tokens
        change; its own would install a BOS/EOS template)."""
        eos = str(self.eos_token)
        self._tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{eos} $A", pair=f"{eos} $A $B",
            special_tokens=[(eos, self._tokenizer.token_to_id(eos))])
