"""The model family: looped Transformer LMs (looped, additive, SCSE) and untied references."""

from scse_dist.model.blocks import Block, RMSNorm, residual_constants
from scse_dist.model.flops import flops_per_token
from scse_dist.model.looped_lm import LMOutput, LoopedLM
from scse_dist.model.recurrence import LoopCore

__all__ = ["Block", "LMOutput", "LoopCore", "LoopedLM", "RMSNorm", "flops_per_token",
           "residual_constants"]
