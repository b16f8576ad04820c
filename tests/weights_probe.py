"""A test callback (named in train.callbacks, tests/ on PYTHONPATH) that lets a test see inside a
real training run: the full fp32 weights after the steps it lists (`out/step-N.safetensors`) and,
every step, what the update gate was shown (`out/steps.jsonl`: step, loss, grad_norm, refused,
skipped), both written by rank 0."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from scse_dist.train.callbacks import Callback, TrainState


class WeightsAt(Callback):
    @dataclass
    class Config:
        out: str
        steps: list[int] = field(default_factory=list)

    priority = -50  # after the spike callback's count, before the checkpoint

    def __init__(self, config: Config) -> None:
        self.out, self.steps = Path(config.out), set(config.steps)

    def on_step_end(self, state: TrainState) -> None:
        from safetensors.torch import save_file

        from scse_dist.checkpoint.zero_weights import fp32_state_dict

        result = state.result
        if state.rank0:
            self.out.mkdir(parents=True, exist_ok=True)
        if state.step in self.steps:
            params = fp32_state_dict(state.engine)  # every rank: ZeRO-3 gathers its partitions
            if state.rank0:
                save_file(params, str(self.out / f"step-{state.step}.safetensors"))
        if state.rank0:
            row = {"step": state.step, "loss": result.loss, "grad_norm": result.grad_norm,
                   "refused": result.refused, "skipped": result.skipped}
            with open(self.out / "steps.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
