"""The trainer's concerns, one callback each (hooks and their order: callbacks.base)."""

from scse_dist.train.callbacks.base import Callback, TrainState, every

__all__ = ["Callback", "TrainState", "every"]
