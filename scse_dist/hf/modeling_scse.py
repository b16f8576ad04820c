"""`ScseForCausalLM`: an scse-dist `LoopedLM` as a Hugging Face causal LM (remote code).

In an export this file sits beside the model package's own modules (looped_lm.py, blocks.py, ...,
copied flat by scse_dist.hf.write_hf_files): the architecture is the project's one implementation,
wrapped, never re-implemented. Works with transformers 4.57 and 5.x.

Loop depth and read-outs are named arguments of `forward`, so `generate(..., num_steps=8)` passes
transformers' keyword validation (it accepts forward's parameters because
prepare_inputs_for_generation takes **kwargs):
- num_steps: loop depth T (default: the config's `depth`; untied models have one fixed depth);
- readout_depths: also read out these depths of the same loop run (`logits_by_depth`);
- exit_rule: an ExitRule or its text ("motion:0.02,max=32"): per-token adaptive depth.
`attention_mask` (left padding) and `position_ids` are honoured: a left-padded batch gives each
sequence the logits it has alone.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_scse import ScseConfig
from .looped_lm import LoopedLM
from .loss import IGNORE_INDEX

# transformers 4.57 copies into its module cache only the modules a remote file imports itself
# (`from .NAME import`), not theirs, yet hashes them all: so this file imports every module of
# the package that it and configuration_scse.py reach (tests/test_hf_export.py checks the list).
from .blocks import Block  # noqa: F401
from .config import ModelConfig  # noqa: F401
from .exit_rules import parse_exit_rule
from .kv_cache import KVCache  # noqa: F401
from .recurrence import LoopCore  # noqa: F401
from .transitions import transition_for  # noqa: F401

# forward's loop arguments, which generation hands on to every step.
LOOP_ARGUMENTS = ("num_steps", "readout_depths", "exit_rule")


@dataclass
class ScseCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus {depth: logits} when readout_depths was given."""

    logits_by_depth: Optional[dict] = None


def _cache_length(cache) -> int:
    """Tokens held by a transformers Cache (4.57 and 5.x: get_seq_length) or a legacy tuple."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2]) if len(cache) else 0


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
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None, **kwargs):
        """Logits at loop depth `num_steps` (see the module docstring). labels: the input ids (or
        -100), shifted inside as usual for causal LMs. kwargs transformers passes and this model
        does not use (cache_position, output_attentions, ...) are ignored; inputs_embeds is refused."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("ScseForCausalLM: inputs_embeds is not supported; pass input_ids")
        past_key_values = kwargs.get("cache", past_key_values)  # 5.x renames it `cache`
        if _cache_length(past_key_values):
            # The cache hook: until the model package has a KV cache, a filled cache cannot be
            # honoured (input_ids would hold only the new tokens), so refuse rather than be wrong.
            raise ValueError("ScseForCausalLM: this model has no KV cache yet; call it on the "
                             "whole sequence with past_key_values=None (generate does)")
        if attention_mask is not None and position_ids is None and bool(attention_mask.all()):
            attention_mask = None  # no padding: the plain causal path the model was trained on
        loop_args = {"depth": num_steps, "readout_depths": readout_depths}
        if exit_rule is not None:
            loop_args["exit_rule"] = (parse_exit_rule(exit_rule) if isinstance(exit_rule, str)
                                      else exit_rule)
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **loop_args)
        loss = None
        if labels is not None:  # next-token targets: labels shifted left, the last one ignored
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
        # No cache is returned (the field is `past_key_values` in 4.x, `cache` in 5.x: left unset).
        output = ScseCausalLMOutput(loss=loss, logits=out.logits, logits_by_depth=out.logits_by_depth)
        return output if return_dict is not False else output.to_tuple()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """generate builds no DynamicCache (4.57 and 5.x both ask this), whatever use_cache says:
        the model has no KV cache yet. With one, this and prepare_inputs_for_generation change."""
        return False

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      **kwargs):
        """Every generated token re-runs the whole sequence at depth num_steps: exact, with no
        cache (so no Cache construction, and cache_position unused, in either transformers
        version). A KV cache plugs in here: pass the cache and only the new tokens."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        inputs.update({name: kwargs[name] for name in LOOP_ARGUMENTS if name in kwargs})
        return inputs
