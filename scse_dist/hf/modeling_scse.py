"""`ScseForCausalLM`: an scse-dist `LoopedLM` as a Hugging Face causal LM (remote code; its
use: docs/using-the-model.md). In an export this file sits beside the model package's own
modules: the architecture is wrapped, never re-implemented. Works with transformers 4.57 and 5.x.

Loop depth and read-outs are named arguments of `forward`, so `generate(..., num_steps=8)` passes
transformers' keyword validation: num_steps (loop depth T, default the config's `depth`),
readout_depths (`logits_by_depth` of the same loop run), exit_rule (an ExitRule or its text),
cache_mode ("exact" or "shared"). The KV cache is the model's own (kv_cache.KVCache, per physical
block x loop step) wrapped in `ScseCache`; `generate` uses it unless `use_cache=False`.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 4.57 copies into its module cache only the modules a remote file imports itself
# (`from .NAME import`), not theirs, yet hashes them all: so this file imports every module of
# the package that it and configuration_scse.py reach (tests/test_hf_export.py checks the list).
from .blocks import Block  # noqa: F401
from .config import ModelConfig  # noqa: F401
from .configuration_scse import ScseConfig
from .documents import AttnMask  # noqa: F401
from .exit_rules import parse_exit_rule
from .kv_cache import KVCache
from .looped_lm import LoopedLM
from .loss import IGNORE_INDEX
from .recurrence import LoopCore  # noqa: F401
from .transitions import transition_for  # noqa: F401

# forward's loop arguments, which generation hands on to every step.
LOOP_ARGUMENTS = ("num_steps", "readout_depths", "exit_rule")
# Keyword arguments transformers (generate, pipelines) or lm-eval may pass that forward ignores;
# any other is a TypeError: `depth=` or a typo would otherwise run at the config's depth unnoticed.
IGNORED_ARGUMENTS = frozenset({"inputs_embeds", "cache_position", "output_attentions",
                               "output_hidden_states", "logits_to_keep", "num_logits_to_keep",
                               "token_type_ids", "head_mask"})


def _refuse_unknown(names, allowed=IGNORED_ARGUMENTS) -> None:
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise TypeError(f"ScseForCausalLM: unexpected keyword argument(s) {', '.join(unknown)}; "
                        "the loop depth is `num_steps`")
# The output's cache field: `cache` in 5.x, `past_key_values` in 4.x.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ \
    else "past_key_values"


@dataclass
class ScseCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus {depth: logits} when readout_depths was given."""

    logits_by_depth: Optional[dict] = None


class ScseCache(Cache):
    """The model's KVCache as a transformers `Cache`, so generate keeps and hands it back. It
    holds no transformers layers: the K/V live in `kv`, per physical block x loop step; what
    would edit them behind the model's back (crop, beam reordering) refuses."""

    def __init__(self, mode: str = "exact") -> None:
        super().__init__(layers=[])
        self.kv = KVCache(mode)

    @property
    def mode(self) -> str:
        return self.kv.mode

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.kv)

    # (the base class's properties; 5.x reads is_croppable: no rollback for assisted decoding)
    is_compileable = is_croppable = False

    def reset(self) -> None:
        self.kv = KVCache(self.kv.mode)

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("ScseCache: the loop-step KV cache cannot be cropped or "
                                  "reordered (beam search, assisted decoding); generate with "
                                  "num_beams=1, or use_cache=False")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


class ScseForCausalLM(PreTrainedModel, GenerationMixin):  # GenerationMixin explicitly: 4.50+
    config_class = ScseConfig
    # model.safetensors holds LoopedLM's own names (`embed.weight`, ...); they live under
    # `model.` here, and transformers adds that prefix when a checkpoint lacks it.
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # LoopCore reuses its blocks every step, so it cannot be split over devices.
    _no_split_modules = ["LoopCore", "Block"]
    supports_gradient_checkpointing = False  # LoopedLM has its own (activation_checkpointing)

    def __init__(self, config: ScseConfig):
        super().__init__(config)
        self.model = LoopedLM(config.model_config())
        self.post_init()

    def _init_weights(self, module):
        """LoopedLM initialises itself; loading overwrites every parameter anyway."""

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head  # None when tied: the head reads the embedding matrix

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None,
                labels: Optional[torch.LongTensor] = None, num_steps: Optional[int] = None,
                readout_depths: Optional[list] = None, exit_rule=None,
                cache_mode: Optional[str] = None, use_cache: Optional[bool] = None,
                return_dict: Optional[bool] = None, cache=None, **kwargs):
        """Logits at loop depth `num_steps` (see the module docstring). labels: the input ids (or
        -100), shifted inside. The kwargs IGNORED_ARGUMENTS names are ignored, any other is a
        TypeError; inputs_embeds is refused. With use_cache=True or a `past_key_values` (an
        ScseCache this model returned): input_ids are the tokens after the cached ones,
        attention_mask covers them (or all),
        positions come from the cache, no autograd; otherwise the whole sequence is computed.
        `cache`: 5.x's name for past_key_values."""
        _refuse_unknown(kwargs)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ScseForCausalLM: inputs_embeds is not supported; pass input_ids")
        cache = past_key_values if cache is None else cache
        if cache is not None and use_cache is False:
            raise ValueError("ScseForCausalLM: past_key_values given with use_cache=False")
        if exit_rule is not None:
            exit_rule = parse_exit_rule(exit_rule) if isinstance(exit_rule, str) else exit_rule
        if cache is not None or use_cache:
            logits, cache = self._decode(input_ids, attention_mask, position_ids, cache,
                                         num_steps, readout_depths, exit_rule, cache_mode)
            logits_by_depth = None
        else:
            if cache_mode is not None:
                raise ValueError("ScseForCausalLM: cache_mode needs use_cache=True")
            if attention_mask is not None and position_ids is None and bool(attention_mask.all()):
                attention_mask = None  # no padding: the plain causal path the model was trained on
            loop_args = {"depth": num_steps, "readout_depths": readout_depths}
            if exit_rule is not None:
                loop_args["exit_rule"] = exit_rule
            out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             **loop_args)
            logits, logits_by_depth = out.logits, out.logits_by_depth
        loss = None
        if labels is not None:  # next-token targets: labels shifted left, the last one ignored
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
        output = ScseCausalLMOutput(loss=loss, logits=logits, logits_by_depth=logits_by_depth,
                                    **{CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()

    def _decode(self, input_ids, attention_mask, position_ids, cache, num_steps, readout_depths,
                exit_rule, cache_mode) -> tuple[torch.Tensor, ScseCache]:
        """Logits of the new tokens through the KV cache (LoopedLM.decode_step), and the cache."""
        if cache is None:
            cache = ScseCache(cache_mode or "exact")
        elif not isinstance(cache, ScseCache):
            raise ValueError(f"ScseForCausalLM: past_key_values must be the ScseCache this model "
                             f"returned (K/V per block x loop step), not {type(cache).__name__}; "
                             f"start with past_key_values=None and use_cache=True")
        elif cache_mode is not None and cache_mode != cache.mode:
            raise ValueError(f"ScseForCausalLM: cache_mode={cache_mode!r}, but the cache given "
                             f"is {cache.mode!r}")
        if readout_depths is not None:
            raise ValueError("ScseForCausalLM: readout_depths needs use_cache=False")
        if position_ids is not None:
            raise ValueError("ScseForCausalLM: with the KV cache, positions follow from the "
                             "cache and attention_mask; pass no position_ids")
        if attention_mask is not None:
            past, new = len(cache.kv), input_ids.shape[1]
            if attention_mask.shape[1] == past + new:  # transformers' convention: the whole mask
                attention_mask = attention_mask[:, past:]
            elif attention_mask.shape[1] != new:
                raise ValueError(f"ScseForCausalLM: attention_mask has {attention_mask.shape[1]} "
                                 f"columns; want the {new} new tokens' (or {past + new})")
        out = self.model.decode_step(input_ids, cache.kv, depth=num_steps,
                                     attention_mask=attention_mask, exit_rule=exit_rule)
        return out.logits, cache

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No DynamicCache from generate: forward makes its own ScseCache on the first call."""
        return False

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      use_cache=None, cache_mode=None, cache=None, **kwargs):
        """One generation step's forward inputs, the same in 4.57 and 5.x: with the cache (the
        default) the tokens after the cached ones; without, the whole sequence."""
        cache = past_key_values if cache is None else cache  # 5.x names it `cache`
        inputs = {name: kwargs[name] for name in LOOP_ARGUMENTS if name in kwargs}
        if cache_mode is not None:
            inputs["cache_mode"] = cache_mode
        if cache is None and not use_cache:
            return {**inputs, "input_ids": input_ids, "attention_mask": attention_mask,
                    "use_cache": False}
        past = 0 if cache is None else cache.get_seq_length()
        return {**inputs, "input_ids": input_ids[:, past:], "past_key_values": cache,
                "attention_mask": None if attention_mask is None else attention_mask[:, past:],
                "use_cache": True}
