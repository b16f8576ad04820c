"""The training loop: `train(cfg)` from process group to exported, evaluated model, top to bottom."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from scse_dist.config import ConfigError, RunConfig, config_to_dict, save_config
from scse_dist.distributed import barrier, describe_placement, init_distributed, shutdown
from scse_dist.checkpoint.tags import export_final, resume_if_present, save_checkpoint, tag_for
from scse_dist.train.depth import sample_depth
from scse_dist.train.diagnostics import diagnostics_for
from scse_dist.train.engine import build_engine
from scse_dist.train.faults import (REQUEUE_EXIT_CODE, FaultInjector, NonFiniteCounter,
                                   PreemptionFlag, TrainingStopped)
from scse_dist.train.metrics import MetricsLogger, peak_flops, peak_memory
from scse_dist.checkpoint.resume import plan_resume
from scse_dist.train.step import sum_over_ranks, train_step
from scse_dist.checkpoint.storage import RunStorage
from scse_dist.train.warm_start import maybe_init_from


def _seed_everything(seed: int) -> None:
    # Same seed on every rank: identical initial weights (ZeRO also broadcasts them) and depth draws.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def with_world_batch(cfg: RunConfig, world_size: int) -> RunConfig:
    """cfg with grad_accum_steps derived from train.global_batch_size at this world size."""
    accum = cfg.train.grad_accum_for(world_size)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=accum))


def train(cfg: RunConfig) -> dict[str, Any]:
    """Train `cfg` on every rank of the launcher's world; return a summary (complete on rank 0)."""
    from scse_dist.data.quickstart import ensure_data
    from scse_dist.data.stream import TokenStream
    from scse_dist.data.preflight import load_run_tokenizer
    from scse_dist.model import LoopedLM, flops_per_token

    # Installed first, so a preemption during start-up is also honoured at the first step.
    preemption = PreemptionFlag().install()
    env = init_distributed()
    if env.world_size > 1:  # every rank, so that a multi-node log shows each one started, and where
        print(describe_placement(env, os.environ), flush=True)
    cfg = with_world_batch(cfg, env.world_size)
    rank0 = env.rank == 0
    storage = RunStorage.for_config(cfg)  # a remote output_dir: run_dir is a local staging dir
    run_dir = storage.local
    if rank0:  # one rank builds the data and writes the run dir, the others wait for it
        ensure_data(cfg.data)
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    storage.fetch_latest()  # remote runs: the checkpoint to resume from, onto every node
    # Verified, and its config compared with this one, before anything is built or loaded; a
    # refused config leaves the run dir as it was (config.yaml included).
    resume_tag = plan_resume(cfg, run_dir, remote=storage.remote is not None)
    if rank0:
        save_config(cfg, run_dir / "config.yaml")

    tokenizer = load_run_tokenizer(cfg)
    # The data is opened before the engine is built, so bad data (another tokenizer's shards,
    # too few documents) stops the run in seconds.
    stream = TokenStream.from_config(cfg.data, "train", cfg.train.micro_batch_size, env.rank,
                                     env.world_size, cfg.train.seed, tokenizer.sha256)
    _seed_everything(cfg.train.seed)
    if not torch.cuda.is_available():
        # Zero-start ablations produce subnormal floats, which make CPU math ~10x slower.
        torch.set_flush_denormal(True)
    model = LoopedLM(cfg.model)
    n_params = model.num_parameters()  # before ZeRO-3 partitions them to empty placeholders
    # Before the engine: ZeRO-3 then partitions the loaded weights.
    maybe_init_from(model, cfg.train, resume_tag is not None, rank0)
    engine, ds_config = build_engine(cfg, model)
    start_step = resume_if_present(engine, run_dir, stream, resume_tag)
    t = cfg.train
    if start_step > t.max_steps:
        # Going on would save this model as checkpoint step-<max_steps> and point `latest` at it.
        raise ConfigError(
            f"train.max_steps: {run_dir} resumed at step {start_step}, past train.max_steps="
            f"{t.max_steps}: raise train.max_steps to continue that run, or give this one another "
            "name or output_dir")
    batches = iter(stream)

    logger = MetricsLogger(str(run_dir), rank0, cfg.wandb, cfg.name, config_to_dict(cfg))
    peak = peak_flops(engine.device) if rank0 else None
    tokens_per_step = env.world_size * t.micro_batch_size * t.grad_accum_steps * cfg.data.seq_len
    if rank0:
        print(f"training {cfg.name}: {n_params:,} parameters, world {env.world_size} "
              f"({env.launcher}), ZeRO-{ds_config['zero_optimization']['stage']}, "
              f"{'bf16' if ds_config['bf16']['enabled'] else 'fp32'}, steps {start_step}..{t.max_steps}",
              flush=True)

    # Loop diagnostics every train.diagnostics_every steps (docs/loop-diagnostics.md).
    diagnostics = diagnostics_for(cfg, ds_config["zero_optimization"]["stage"], rank0)
    faults = FaultInjector(env.rank)
    nonfinite = NonFiniteCounter(t.max_nonfinite_steps)
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    last_saved = start_step if start_step else -1
    preempted_by: Optional[str] = None
    window_start, window_steps, window_flops = time.perf_counter(), 0, 0.0
    loss_window = torch.zeros(2, device=engine.device)  # (sum of good micro-batch losses, count)
    try:
        for step in range(start_step, t.max_steps):
            done = step + 1
            faults.step_started(done)
            # Untied models have one fixed depth; the loop kinds draw T per step, the same on all ranks.
            depth = None if model.fixed_depth is not None else \
                sample_depth(step, t.depth, cfg.model.depth, t.seed)
            lr = engine.get_lr()[0]  # the lr this step uses: the scheduler advances inside engine.step
            result = train_step(engine, (next(batches) for _ in range(t.grad_accum_steps)),
                                depth=depth, backprop_steps=t.depth.backprop_steps,
                                stop_requested=lambda: preemption.requested,
                                loss_hook=lambda loss: faults.loss(done, loss),
                                before_update=lambda engine: diagnostics.before_update(engine, done))
            diag_row = diagnostics.on_step_end(engine.module, done)
            nonfinite.update(done, result.skipped, tag_for(last_saved) if last_saved > 0 else None)
            if result.skipped and rank0:
                print(f"step {done}: non-finite loss or gradient, step skipped ({nonfinite.in_a_row} "
                      f"in a row, {nonfinite.total} in all)", flush=True)
            if not result.skipped:
                loss_window += torch.stack([result.loss_sum, torch.tensor(float(result.micro_batches))
                                            .to(result.loss_sum)])
            window_steps += 1
            window_flops += flops_per_token(cfg.model, result.depth, cfg.data.seq_len)

            if done % t.log_every == 0 or done == t.max_steps or done == start_step + 1:
                # loss sum, token count and bad-input events (skipped corrupt shards or samples)
                # of every rank in one all-reduce
                total, count, data_failures = sum_over_ranks(
                    torch.cat([loss_window, loss_window.new_tensor([stream.failures])])).tolist()
                loss = total / count if count else float("nan")
                elapsed = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                mfu = (window_flops / window_steps) * tokens_per_s / (env.world_size * peak) \
                    if peak else None
                logger.log({"step": done, "loss": loss, "lr": lr, "depth": result.depth,
                            "tokens_per_s": tokens_per_s, "mfu": mfu,
                            "step_time_s": elapsed / window_steps, "tokens": done * tokens_per_step,
                            "skipped_steps": nonfinite.total, "data_failures": int(data_failures),
                            **peak_memory(engine.device), **diag_row})
                diag_row = {}
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                window_start, window_steps, window_flops = time.perf_counter(), 0, 0.0
                loss_window.zero_()
            if diag_row:  # diagnostics off the log steps get a row of their own
                logger.log({"step": done, **diag_row})
            if done % t.checkpoint_every == 0 or done == t.max_steps or result.stop:
                save_checkpoint(engine, run_dir, done, stream, cfg, faults, storage)
                last_saved = done
            if result.stop:
                preempted_by = preemption.signal_name or "a signal on another rank"
                break
    except TrainingStopped:
        storage.finish()  # the last good checkpoint reaches the remote run dir
        logger.close()
        shutdown(engine)
        raise
    finally:
        # Preempted: the flag handlers stay, so that a second signal cannot kill a rank that is
        # still shutting down (scse-train then ignores these signals until exit; see cli.main).
        if preempted_by is None:
            preemption.uninstall()

    summary: dict[str, Any] = {"run_dir": str(run_dir), "rank": env.rank, "steps": t.max_steps,
                               "resumed_from": start_step, "first_loss": first_loss,
                               "final_loss": last_loss, "export_dir": None, "eval_path": None,
                               "preempted": preempted_by}
    if preempted_by is not None:
        storage.finish()  # a tag the remote still lacks is reported; the requeue retries it
        logger.close()
        shutdown(engine)
        if rank0:
            print(f"preempted by {preempted_by}: saved {tag_for(last_saved)} after step {last_saved}; "
                  f"rerun to resume (exit status {REQUEUE_EXIT_CODE})", flush=True)
        return {**summary, "steps": last_saved}

    if last_saved != t.max_steps:  # resumed at max_steps already, or a run of zero steps
        save_checkpoint(engine, run_dir, t.max_steps, stream, cfg, faults, storage)
    not_uploaded = storage.finish()  # also before the export: it may read other nodes' shards
    barrier()
    export_dir = summary["export_dir"] = export_final(engine, cfg, run_dir, tag_for(t.max_steps),
                                                      storage)
    logger.close()
    # Collective teardown first (barrier, destroy, barrier, destroy group: no gloo abort at exit);
    # the held-out eval then runs on rank 0 alone, so no peer waits on it past a collective timeout.
    shutdown(engine)

    if rank0 and cfg.eval.after_train:
        summary["eval_path"] = _evaluate_export(export_dir, cfg, run_dir)
    if rank0:
        storage.upload_outputs("export", "eval", "metrics.jsonl")
        if not_uploaded:  # everything else is done; the checkpoint is only in staging
            raise OSError(f"{storage.remote}: checkpoint {', '.join(not_uploaded)} could not be "
                          f"uploaded (see above); it is kept in {run_dir / 'checkpoints'}: rerun "
                          "the same command on this machine to upload it")
        print(f"run dir {run_dir}: metrics.jsonl, checkpoints/, export/ ({export_dir})"
              + (f", eval {summary['eval_path']}" if summary["eval_path"] else ""), flush=True)
    return summary


def _evaluate_export(export_dir: str, cfg: RunConfig, run_dir: Path) -> str:
    from scse_dist.eval.cli import run_heldout_eval
    from scse_dist.checkpoint.export import load_exported_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, export_cfg = load_exported_model(export_dir, device=device)
    out_path = str(run_dir / "eval" / "heldout.json")
    run_heldout_eval(model, export_cfg, cfg.data.path, cfg.eval.depths, out_path,
                     checkpoint_label=f"{cfg.name}@{tag_for(cfg.train.max_steps)}",
                     max_batches=cfg.eval.max_batches)
    return out_path
