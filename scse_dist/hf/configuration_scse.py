"""`ScseConfig`: the Hugging Face config of an scse-dist model (remote code, see scse_dist/hf).

Its fields are those of the model package's `ModelConfig` (config.py, copied beside this file in
an export), with the same defaults; `model_config()` turns them back into the ModelConfig that
`LoopedLM` is built from, checked by the package's own `check_model_config`.
"""

import dataclasses

from transformers import PretrainedConfig

from .blocks import Block  # noqa: F401
from .config import VALUE_BEFORE_FIELD, ModelConfig
from .documents import AttnMask  # noqa: F401

# transformers 4.57 copies only the modules this file imports itself; transitions.py reaches
# config.py, and these are reached too (see modeling_scse.py).
from .exit_rules import ExitRule  # noqa: F401
from .kv_cache import KVCache  # noqa: F401
from .recurrence import LoopCore  # noqa: F401
from .transitions import check_model_config

# An export's config.json names every field; one written before a field existed ran with the
# value that field had then (VALUE_BEFORE_FIELD), like a saved run config.
MODEL_FIELDS = {**{f.name: f.default for f in dataclasses.fields(ModelConfig)},
                **VALUE_BEFORE_FIELD}
# Fields whose name PretrainedConfig owns (transformers 5's rope_scaling is a property that
# rewrites rope_parameters): kept under another attribute, read from config.json by either name.
RENAMED = {"rope_scaling": "scse_rope_scaling"}


class ScseConfig(PretrainedConfig):
    model_type = "scse"
    # The names other transformers code reads, mapped onto ModelConfig's.
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads",
                     "max_position_embeddings": "max_seq_len"}

    def __init__(self, **kwargs):
        for name, default in MODEL_FIELDS.items():
            attr = RENAMED.get(name, name)
            setattr(self, attr, kwargs.pop(attr, kwargs.pop(name, default)))
        # A tied head is structural in LoopedLM (the head reads the embedding): transformers
        # has nothing to tie, and with False neither 4.x nor 5.x looks for an output embedding.
        kwargs["tie_word_embeddings"] = False
        # generate uses the model's own KV cache (ScseCache in modeling_scse) unless told not to.
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        cfg = ModelConfig(**{name: getattr(self, RENAMED.get(name, name))
                             for name in MODEL_FIELDS})
        check_model_config(cfg)
        return cfg
