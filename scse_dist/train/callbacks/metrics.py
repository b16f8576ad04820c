"""The training row: loss, lr, depth, throughput and MFU every train.log_every steps, to the
console, metrics.jsonl and wandb (scse_dist.train.metrics.MetricsLogger, rank 0)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from scse_dist.progress import eta_seconds, format_duration
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.depth import depth_mean
from scse_dist.train.metrics import peak_flops, peak_memory
from scse_dist.train.step import sum_over_ranks


class MetricsCallback(Callback):
    """Averages the loss over the steps since the last row (all ranks, one all-reduce per row);
    throughput and step time count the steps' own time (data and diagnostics included), not
    evaluations or checkpoint saves between them."""

    priority = 300

    def __init__(self) -> None:
        # The run's first and last logged loss: its state, so the first stays across resumes
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None

    def state_dict(self) -> dict[str, Any]:
        return {"first_loss": self.first_loss, "last_loss": self.last_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first_loss, self.last_loss = state["first_loss"], state["last_loss"]

    def on_start(self, state: TrainState) -> None:
        from scse_dist.model import flops_per_token

        state.first_loss, state.last_loss = self.first_loss, self.last_loss
        self.flops_per_token = flops_per_token
        self.peak = peak_flops(state.engine.device) if state.rank0 else None
        self.started = time.perf_counter()  # elapsed and ETA count this process's steps
        # (sum of good micro-batch losses, count, sum of their z-loss terms, sum of their losses
        # at train.loss.depth's short depth, count of those) since the last row
        self.loss_window = torch.zeros(5, device=state.engine.device)
        self._new_window()

    def _new_window(self) -> None:
        self.window_seconds, self.window_steps, self.window_flops = 0.0, 0, 0.0
        self.loss_window.zero_()

    def on_step_end(self, state: TrainState) -> None:
        result = state.result
        if not result.skipped:
            zero = result.loss_sum.new_zeros(())
            z_sum = zero if result.z_loss_sum is None else result.z_loss_sum
            short_sum = zero if result.short_loss_sum is None else result.short_loss_sum
            self.loss_window += torch.stack([result.loss_sum, zero + result.micro_batches, z_sum,
                                             short_sum, zero + result.short_micro_batches])
        self.window_steps += 1
        self.window_seconds += state.step_seconds
        self.window_flops += self.flops_per_token(state.cfg.model, result.depth,
                                                  state.cfg.data.seq_len,
                                                  state.cfg.train.depth.backprop_steps)
        step = state.step
        if step % state.cfg.train.log_every == 0 or step == state.max_steps \
                or step == state.start_step + 1:
            self._log(state)
        elif state.metrics_extra:  # loop diagnostics off a log step: a row of their own
            state.logger.log({"step": step, **state.metrics_extra})
        state.metrics_extra.clear()

    def _log(self, state: TrainState) -> None:
        # loss sum, token count and bad-input events (skipped corrupt shards or samples) of every
        # rank in one all-reduce
        total, count, z_total, short_total, short_count, data_failures = sum_over_ranks(torch.cat(
            [self.loss_window, self.loss_window.new_tensor([state.stream.failures])])).tolist()
        loss = total / count if count else float("nan")
        # train.loss.z_loss's term, beside the cross-entropy `loss` (their sum was minimised)
        z_loss = {"z_loss": z_total / count if count else float("nan")} \
            if state.cfg.train.loss.z_loss else {}
        # train.loss.depth: the cross-entropy at its short depth (NaN: no step of the window ran
        # deeper than it)
        short = {"loss_short": short_total / short_count if short_count else float("nan")} \
            if state.cfg.train.loss.depth.kind != "off" else {}
        seconds = self.window_seconds
        tokens_per_s = state.tokens_per_step * self.window_steps / seconds
        mfu = (self.window_flops / self.window_steps) * tokens_per_s \
            / (state.env.world_size * self.peak) if self.peak else None
        state.logger.log({
            "step": state.step, "loss": loss, **z_loss, **short, "lr": state.lr,
            "depth": state.result.depth, **self._depth_mean(state),
            "tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": seconds / self.window_steps,
            "tokens": state.step * state.tokens_per_step, "skipped_steps": state.skipped_steps,
            # the spike_skip callback on: the loss spikes skipped so far
            **({} if state.spike_skips is None else {"spike_skips": state.spike_skips}),
            "data_failures": int(data_failures), **peak_memory(state.engine.device),
            **state.metrics_extra},
            console_tail=self._progress(state))
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        state.first_loss, state.last_loss = self.first_loss, self.last_loss
        self._new_window()

    @staticmethod
    def _depth_mean(state: TrainState) -> dict[str, float]:
        """train.depth.curriculum on: `depth_mean`, the mean the row's step drew around."""
        t = state.cfg.train
        if t.depth.curriculum.shape == "none":
            return {}
        return {"depth_mean": depth_mean(state.step - 1, t.depth, state.cfg.model.depth,
                                         t.max_steps)}

    def _progress(self, state: TrainState) -> str:
        """` | elapsed 1:02 | ETA 5:10`: time since this process's first step, and the rest at
        the rate so far (evaluation and checkpoints included)."""
        elapsed = time.perf_counter() - self.started
        eta = eta_seconds(state.step - state.start_step, state.max_steps - state.start_step,
                          elapsed)
        return f" | elapsed {format_duration(elapsed)} | ETA {format_duration(eta)}"
