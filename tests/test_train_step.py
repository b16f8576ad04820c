"""train_step's objective (the LM loss plus model.loop_stability's term) and its update hook,
with a stand-in engine that records what it is asked to do."""

from __future__ import annotations

import pytest
import torch

from scse_dist.model import LoopedLM
from scse_dist.model.config import ModelConfig
from scse_dist.train.step import train_step


class RecordingEngine:
    """The DeepSpeed engine surface train_step uses, over a plain module at ZeRO stage 0."""

    def __init__(self, module: torch.nn.Module, accum: int = 2) -> None:
        self.module, self.accum, self.device = module, accum, torch.device("cpu")
        self.events: list[tuple[str, float]] = []
        self.optimizer = type("Opt", (), {"step": lambda self: None})()

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def zero_optimization_stage(self) -> int:
        return 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, objective: torch.Tensor) -> None:
        self.events.append(("backward", float(objective.detach())))
        objective.backward()

    def step(self) -> None:
        self.events.append(("step", 0.0))

    def was_step_applied(self) -> bool:
        return True


def windows(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 9), generator=g) for _ in range(n)]


def test_stability_term_joins_the_objective_not_the_logged_loss() -> None:
    torch.manual_seed(0)
    model = LoopedLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, max_seq_len=32, depth=3,
                                 loop_stability=0.5))
    engine = RecordingEngine(model)
    seen = []
    result = train_step(engine, windows(2), depth=3,
                        before_update=lambda e: seen.append(list(e.events)))
    want = [model(w[:, :-1], w[:, 1:], depth=3) for w in windows(2)]  # with grad: the term is on
    assert float(result.loss_sum) == pytest.approx(sum(float(o.loss.detach()) for o in want),
                                                   rel=1e-6)
    backward = [v for kind, v in engine.events if kind == "backward"]
    assert backward == pytest.approx([float((o.loss + o.aux_loss).detach()) for o in want],
                                     rel=1e-6)
    assert all(float(o.aux_loss.detach()) > 0 for o in want)
    # the hook ran once, at the boundary: after both backward passes, before the one update
    assert [[kind for kind, _ in events] for events in seen] == [["backward", "step", "backward"]]
    assert [kind for kind, _ in engine.events] == ["backward", "step", "backward", "step"]
