"""The model family: looped Transformer LMs (looped, additive, SCSE) and untied references.

Self-contained: nothing here imports the rest of scse_dist (relative imports only), so the
package can be copied verbatim, under any name, into an export as remote code. Names load lazily
so that `scse_dist.config` (which imports `.config`) does not import torch.
"""

import importlib

_EXPORTS = {
    "Block": "blocks", "RMSNorm": "blocks", "residual_constants": "blocks",
    "ModelConfig": "config", "check_model_fields": "config",
    "ExitRule": "exit_rules", "parse_exit_rule": "exit_rules", "check_model_config": "transitions",
    "flops_per_token": "flops", "LMOutput": "looped_lm", "LoopedLM": "looped_lm",
    "LoopCore": "recurrence", "Transition": "transitions", "transition_for": "transitions",
    "register": "transitions", "resolved_anchor_scale": "transitions",
    "DecodeOutput": "looped_lm", "KVCache": "kv_cache",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
