"""eval.sample_every: continuations of a few fixed prompts during training, to read along.

Rank 0 generates at the model's default depth with the run's seed (its own generator: training's
random state is untouched), into a `"kind": "sample"` row (docs/monitoring.md), a wandb table and a
console line per prompt. Not under ZeRO-3 (refused at the start).
"""

from __future__ import annotations

from scse_dist.config import ConfigError
from scse_dist.train.callbacks.base import Callback, TrainState, every

SAMPLE_KIND = "sample"


class SampleCallback(Callback):
    priority = 100
    config_key = "eval.sample_every"

    def __init__(self, every_steps: int) -> None:
        self.every_steps = every_steps

    def on_start(self, state: TrainState) -> None:
        if state.engine.zero_optimization_stage() == 3:
            raise ConfigError("eval.sample_every: not with train.engine.zero_stage=3 (each rank "
                              "holds a slice of the weights); set it to 0 or use ZeRO 0-2")
        self.prompts = [state.tokenizer.encode(p) for p in state.cfg.eval.sample_prompts]

    def on_step_end(self, state: TrainState) -> None:
        if state.rank0 and every(self.every_steps, state.step) and not state.result.stop:
            self.sample(state)

    def sample(self, state: TrainState) -> dict:
        from scse_dist.generate import Sampling, continuation_text, generate

        cfg, model = state.cfg, state.engine.module
        sampling = Sampling(temperature=cfg.eval.sample_temperature, seed=cfg.train.seed)
        was_training = model.training
        model.eval()
        try:
            out = generate(model, self.prompts, max_new_tokens=cfg.eval.sample_tokens,
                           sampling=sampling, eos_id=state.tokenizer.eos_id)
        finally:
            model.train(was_training)
        samples = [{"prompt": text, "text": continuation_text(state.tokenizer, ids, new)}
                   for text, ids, new in zip(cfg.eval.sample_prompts, self.prompts, out.tokens)]
        for s in samples:
            print(f"sample step {state.step:>6d} | {s['prompt']!r} -> {s['text']!r}"[:400],
                  flush=True)
        row = {"step": state.step, "kind": SAMPLE_KIND, "depth": cfg.model.depth,
               "temperature": sampling.temperature, "samples": samples}
        state.logger.write(row)
        return row
