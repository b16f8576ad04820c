"""Downstream tasks (LAMBADA, WikiText, multiple choice) during training.

Each task of `tasks` is scored at eval.depths by `scse-eval --task`'s scorer on its
first `max_examples` examples (read at start-up: a bad file stops the run before
step 1), every rank scoring every world-size-th. The ranks' additive totals are summed, so the
numbers are the same at any world size. One row per evaluation, keys `<task>_<metric>_T<depth>`
(docs/monitoring.md); the first evaluation prints its cost in training steps once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from scse_dist.config_paths import field_value
from scse_dist.eval.config import EvalConfig
from scse_dist.eval.curves import DOWNSTREAM_KIND, downstream_key
from scse_dist.task_registry import TASKS, data_path, unknown_task
from scse_dist.train.callbacks.base import Cadence, Callback, TrainState, every, reduce_totals
from scse_dist.train.config import TrainConfig
from scse_dist.typed_yaml import ConfigError


def row_keys(task: str, row: dict) -> dict[str, Any]:
    """A depth's row of `task` as metrics.jsonl keys: {"<task>_<metric>_T<depth>": value}."""
    return {downstream_key(task, m, row["depth"]): row[m] for m in TASKS[task].metrics if m in row}


class DownstreamEvalCallback(Callback):
    @dataclass
    class Config(Cadence):
        tasks: list[str] = field(default_factory=list)
        max_examples: int = field(default=0, metadata={"ge": 0})  # per task and evaluation (0: all)

        def check(self, train: TrainConfig, eval: EvalConfig) -> None:
            able = [name for name, task in TASKS.items() if task.downstream]
            for i, name in enumerate(self.tasks):
                task = TASKS.get(name)
                if task is None or not task.downstream:
                    why = unknown_task(name) if task is None else \
                        f"{name!r} does not run during training (held-out loss: heldout_eval)"
                    raise ConfigError(f"init_args.tasks[{i}]: {why}; the tasks that do: "
                                      f"{', '.join(able)}")
                if task.data_field and not field_value(eval, task.data_field):
                    raise ConfigError(f"init_args.tasks lists {name!r}, so set "
                                      f"eval.{task.data_field} to its data file")
                if name in self.tasks[:i]:
                    raise ConfigError(f"init_args.tasks[{i}]: {name!r} is listed twice")
            if self.every_steps and not self.tasks:
                raise ConfigError("init_args.tasks: every_steps is set, so name the tasks to run "
                                  f"(any of {', '.join(able)})")
            if self.every_steps and train.engine.zero_stage == 3:
                # the scorer applies the LM head outside the forward, where ZeRO-3 partitions it
                raise ConfigError("downstream tasks during training run at ZeRO stage 0, 1 or 2, "
                                  "not train.engine.zero_stage 3; evaluate the checkpoints with "
                                  "scse-eval instead")

    priority = 50  # after the held-out evaluation (200) and the samples (100), before checkpoints

    def __init__(self, config: Config) -> None:
        self.config = config
        self.every_steps = config.every_steps
        self.depths: list[int] = []
        self.shares: dict[str, tuple[int, list]] = {}  # task -> (examples in all, this rank's)
        self.cost_printed = False

    def for_run(self) -> bool:
        return self.every_steps > 0

    def on_start(self, state: TrainState) -> None:
        cfg, env = state.cfg, state.env
        fixed = getattr(state.engine.module, "fixed_depth", None)  # untied: its own depth only
        self.depths = [fixed] if fixed is not None else sorted(set(cfg.eval.depths))
        limit = self.config.max_examples
        for name in self.config.tasks:
            task = TASKS[name]
            examples = list(task.reader(data_path(task, cfg)))
            examples = examples[:limit] if limit else examples
            self.shares[name] = (len(examples), examples[env.rank::env.world_size])

    def on_step_end(self, state: TrainState) -> None:
        if every(self.every_steps, state.step):
            self.evaluate(state)

    def evaluate(self, state: TrainState) -> dict:
        from scse_dist.eval.task_run import TaskRun

        start = time.perf_counter()
        cfg, device = state.cfg, state.engine.device
        seq_len = cfg.data.seq_len
        row: dict[str, Any] = {"step": state.step, "kind": DOWNSTREAM_KIND}
        shown = []
        for name, (n, share) in self.shares.items():
            task, started = TASKS[name], time.perf_counter()
            own = cfg.eval.settings(name)
            stride = getattr(own, "stride", 0) or max(1, seq_len // 2)
            run = TaskRun(state.engine.module, state.tokenizer, share, False, self.depths,
                          seq_len, stride, cfg.eval.batch_size, 0, None, None, {}, own)
            assert task.totals is not None and task.from_totals is not None  # Config.check's
            totals = task.totals(run)
            if state.env.world_size > 1:
                totals = reduce_totals(totals, device)
            rows = [task.from_totals(t) for t in totals]
            for r in rows:
                row.update(row_keys(name, r))
            row[f"{name}_examples"] = n
            row[f"{name}_time_s"] = time.perf_counter() - started  # this rank's, with the sum
            shown.append(f"{name} {task.headline} " + " ".join(
                f"T{r['depth']} {r[task.headline]:.4f}" for r in rows))
        row["downstream_time_s"] = seconds = time.perf_counter() - start
        if state.rank0:
            print(f"downstream step {state.step:>6d} | " + " | ".join(shown)
                  + f" | {seconds:.2f} s", flush=True)
            if not self.cost_printed and state.step_seconds > 0:
                print(f"downstream eval: {seconds:.2f} s, = {seconds / state.step_seconds:.1f} "
                      f"training steps ({state.step_seconds:.3f} s each)", flush=True)
        self.cost_printed = True
        state.logger.write(row)
        return row
