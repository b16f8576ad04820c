"""Continuations of a few fixed prompts during training, to read along.

Rank 0 generates at the model's default depth with the run's seed (its own generator: training's
random state is untouched), into a `"kind": "sample"` row (docs/monitoring.md), a wandb table and a
console line per prompt. Not under ZeRO-3 (refused at the start).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scse_dist.train.callbacks.base import Cadence, Callback, TrainState, every
from scse_dist.train.config import TrainConfig
from scse_dist.typed_yaml import ConfigError

SAMPLE_KIND = "sample"


class SampleCallback(Callback):
    @dataclass
    class Config(Cadence):
        prompts: list[str] = field(
            default_factory=lambda: ["The", "Return the", "This module provides"])
        tokens: int = field(default=32, metadata={"ge": 1})
        temperature: float = field(default=0.8, metadata={"ge": 0})

        def __post_init__(self) -> None:
            if self.every_steps and not all(p.strip() for p in self.prompts or [""]):
                raise ConfigError("prompts: need at least one prompt, none empty, when "
                                  "every_steps is set")

        def check(self, train: TrainConfig) -> None:
            if self.every_steps and train.engine.zero_stage == 3:
                raise ConfigError("not with train.engine.zero_stage=3 (each rank holds a slice "
                                  "of the weights); set every_steps to 0 or use ZeRO 0-2")

    priority = 100

    def __init__(self, config: Config) -> None:
        self.config = config
        self.every_steps = config.every_steps

    def for_run(self) -> bool:
        return self.every_steps > 0

    def on_start(self, state: TrainState) -> None:
        self.prompts = [state.tokenizer.encode(p) for p in self.config.prompts]

    def on_step_end(self, state: TrainState) -> None:
        if state.rank0 and every(self.every_steps, state.step) and not state.result.stop:
            self.sample(state)

    def sample(self, state: TrainState) -> dict:
        from scse_dist.generate import Sampling, continuation_text, generate

        cfg, model = state.cfg, state.engine.module
        sampling = Sampling(temperature=self.config.temperature, seed=cfg.train.seed)
        was_training = model.training
        model.eval()
        try:
            out = generate(model, self.prompts, max_new_tokens=self.config.tokens,
                           sampling=sampling, eos_id=state.tokenizer.eos_id)
        finally:
            model.train(was_training)
        samples = [{"prompt": text, "text": continuation_text(state.tokenizer, ids, new)}
                   for text, ids, new in zip(self.config.prompts, self.prompts, out.tokens)]
        for s in samples:
            print(f"sample step {state.step:>6d} | {s['prompt']!r} -> {s['text']!r}"[:400],
                  flush=True)
        row = {"step": state.step, "kind": SAMPLE_KIND, "depth": cfg.model.depth,
               "temperature": sampling.temperature, "samples": samples}
        state.logger.write(row)
        return row
