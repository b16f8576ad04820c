"""The training loop: `train(cfg)` from process group to exported, evaluated model, top to bottom.

train() sets up (process group, run dir, data, model, engine, resume) into a TrainState, runs the
steps, and hands every concern to a callback (scse_dist.train.callbacks), in priority order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from typing import Any, Literal, Optional, Sequence

import numpy as np
import torch

from scse_dist import run_lock
from scse_dist.atomic import atomic_write, removed_on_failure
from scse_dist.checkpoint.resume import plan_resume
from scse_dist.checkpoint.start_config import StartConfig
from scse_dist.checkpoint.storage import RunStorage
from scse_dist.checkpoint.tags import checkpoint_dir, resume_if_present
from scse_dist.cli_errors import exit_status, one_line
from scse_dist.config import RunConfig, config_to_dict, save_config
from scse_dist.data.config import DataConfig
from scse_dist.distributed import (
    abandon,
    describe_placement,
    init_distributed,
    launcher_world,
    shutdown,
)
from scse_dist.model.config import ModelConfig
from scse_dist.run_dir import EVAL_NAME, EXPORT_NAME, METRICS_NAME, RunDir
from scse_dist.run_lock import RunDirBusy
from scse_dist.threads import configure_threads
from scse_dist.train.callbacks.assembly import configured_callbacks, in_hook_order, restore_states
from scse_dist.train.callbacks.base import Callback, TrainState
from scse_dist.train.config import TrainConfig
from scse_dist.train.depth import sample_depth, short_depth_loss
from scse_dist.train.engine import build_engine
from scse_dist.train.faults import FaultInjector, PreemptionFlag, TrainingStopped
from scse_dist.train.metrics import MetricsLogger, cut_metrics
from scse_dist.train.schedule import follow_config_schedule
from scse_dist.train.step import UpdateGate, train_step
from scse_dist.train.tensorboard import tensorboard_log_dir
from scse_dist.train.warm_start import check_init_config, maybe_init_from
from scse_dist.typed_yaml import ConfigError


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights and depth draws."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def with_world_batch(cfg: RunConfig, world_size: int, world_from: str = "") -> RunConfig:
    """cfg with grad_accum_steps derived from train.batch.global_batch_size at this world size
    (micro_batch_size: auto only checked here), for scripts that build their own engine
    (train.parity, benchmarks); train() resolves its config in _resolved."""
    accum = cfg.train.batch.grad_accum_for(world_size, world_from=world_from)
    if cfg.train.batch.micro_batch_size == "auto":
        return cfg
    batch = dataclasses.replace(cfg.train.batch, grad_accum_steps=accum)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch=batch))


def train(cfg: RunConfig, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Train `cfg` on every rank of the launcher's world; return a summary (complete on rank 0).
    `callbacks` run beside train.callbacks' (the built-ins and the user's; new instances per
    call: they hold the run's state). Rank 0 holds the run dir's lock (scse_dist.run_lock) from
    before its first write to the end, whatever the end."""
    with contextlib.ExitStack() as lock:
        return _train(cfg, callbacks, lock)


def _train(cfg: RunConfig, callbacks: Sequence[Callback], lock: contextlib.ExitStack
           ) -> dict[str, Any]:
    configured = configured_callbacks(cfg)  # a bad entry: before anything starts
    preemption = PreemptionFlag().install()  # first: a signal during start-up is honoured at step 1
    state = None

    def keep_run_dir(exc: BaseException) -> bool:  # a crash's logs, or a checkpoint to resume
        if isinstance(exc, RunDirBusy):  # another process's run dir, made just before ours
            return True
        return state is not None and (state.last_saved > 0 or exit_status(exc) is None)

    # The write rule: a run refused before it saved anything leaves no run dir that it made.
    made = (removed_on_failure(RunStorage.for_config(cfg).local, keep_run_dir)
            if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext())
    with made:
        try:
            try:
                state, saved_states = _start(cfg, lock)
            except BaseException:  # a refused config or bad data: nothing to save or wait for
                abandon()
                raise
            state.preemption = preemption
            state.callbacks = in_hook_order(
                [*(c for c in configured if c.for_run()), *callbacks])
            left = restore_states(state.callbacks, saved_states)
            if left and state.rank0:
                print(f"resumed checkpoint holds the state of callbacks this run does not have, "
                      f"left unused: {', '.join(left)}", flush=True)
            try:
                _run(state, state.callbacks, preemption)
            except TrainingStopped:  # agreed by every rank: an orderly end, then the exit status
                _teardown(state, state.callbacks)
                raise
            except Exception as exc:
                if exit_status(exc) is None:  # a crash, not bad input: its rank and step, in one
                    # line that the launcher's retries read (scse_dist.launch.retries.CRASH_LINE)
                    print(f"scse-train: rank {state.env.rank} crashed after step {state.step}: "
                          f"{type(exc).__name__}: {one_line(exc)}", file=sys.stderr, flush=True)
                raise
        finally:  # a preempted run keeps the handlers, so that a second SIGTERM cannot kill a
            # rank still shutting down (scse-train then ignores them until exit; see cli.main)
            if state is None or state.stop_reason is None:
                preemption.uninstall()
    _teardown(state, state.callbacks)
    state.summary.update(first_loss=state.first_loss, final_loss=state.last_loss,
                         preempted=state.stop_reason)
    if state.stop_reason is not None:
        return {**state.summary, "steps": state.last_saved}
    for callback in state.callbacks:
        callback.after_shutdown(state)
    _publish_outputs(state)
    return state.summary


def _run(state: TrainState, callbacks: list[Callback], preemption: PreemptionFlag) -> None:
    for callback in callbacks:
        callback.on_start(state)
    t, engine = state.cfg.train, state.engine
    model, batches = engine.module, iter(state.stream)
    # model.document_mask: the documents of each window attend within themselves
    eos_id = state.tokenizer.eos_id if state.cfg.model.document_mask else None
    gate = _update_gate(callbacks, state)
    for step in range(state.start_step, t.max_steps):
        state.faults.step_started(step + 1)
        # Untied models have one fixed depth; the loop kinds draw T per step, the same on all ranks.
        depth = (None if model.fixed_depth is not None else
                 sample_depth(step, t.depth, state.cfg.model.depth, t.seed, t.max_steps))
        state.lr = engine.get_lr()[0]  # the lr this step uses: the scheduler advances in step()
        started = time.perf_counter()
        state.result = train_step(engine, (next(batches) for _ in range(t.batch.grad_accum_steps)),
                                  depth=depth, backprop_steps=t.depth.backprop_steps,
                                  stop_requested=lambda: preemption.requested,
                                  loss_hook=lambda loss: state.faults.loss(step + 1, loss),
                                  before_update=lambda engine: _before_update(callbacks, state),
                                  z_loss=t.loss.z_loss, eos_id=eos_id, update_gate=gate,
                                  **short_depth_loss(t))
        state.step_seconds = time.perf_counter() - started  # data in; diagnostics add theirs
        state.step = step + 1
        for callback in callbacks:
            callback.on_step_end(state)
        if state.stop_reason is not None:
            return
    for callback in callbacks:
        callback.on_train_end(state)


def _before_update(callbacks: list[Callback], state: TrainState) -> None:
    for callback in callbacks:
        callback.before_update(state)


def _update_gate(callbacks: list[Callback], state: TrainState) -> Optional[UpdateGate]:
    """The callbacks' allow_update as train_step's gate; None (nothing asked, no gradient norm
    computed) when none overrides it. Every one is asked: each keeps its statistics."""
    gates = [c for c in callbacks if type(c).allow_update is not Callback.allow_update]
    if not gates:
        return None
    return lambda loss, grad_norm: all([c.allow_update(state, loss, grad_norm) for c in gates])


def _teardown(state: TrainState, callbacks: list[Callback]) -> None:
    """The one teardown of an orderly end. Collective first (barrier, destroy, barrier, destroy
    group: no gloo abort at exit); rank 0's work after it (after_shutdown) waits on no peer."""
    for callback in callbacks:
        callback.on_teardown(state)
    state.logger.close()
    shutdown(state.engine)
    if state.stream.failures:  # each was one line as it came: the total
        print(f"scse-train: rank {state.env.rank}: {state.stream.failures} bad shards/samples "
              f"skipped in all (data.max_failures={state.cfg.data.max_failures})",
              file=sys.stderr, flush=True)


def _start(cfg: RunConfig, lock: contextlib.ExitStack) -> tuple[TrainState, dict[str, Any]]:
    """Process group, run dir (its lock entered into `lock` on rank 0), data, model, engine and
    the resumed step, as a TrainState, and the callbacks' states the resumed checkpoint saved
    ({} for a fresh start)."""
    from scse_dist.data.preflight import load_run_tokenizer
    from scse_dist.data.stream import TokenStream

    # a global batch that does not divide: one line before any process group starts
    world_size, world_from = launcher_world(os.environ)
    cfg.train.batch.grad_accum_for(world_size, world_from=world_from)
    env = init_distributed()
    if env.world_size > 1:  # every rank, so that a multi-node log shows each one started, and where
        print(describe_placement(env, os.environ), flush=True)
    if not torch.cuda.is_available():  # intra-op threads from the free cores (OMP_NUM_THREADS wins)
        configure_threads()
        # Zero-start ablations produce subnormal floats, which make CPU math ~10x slower.
        torch.set_flush_denormal(True)
    storage = RunStorage.for_config(cfg)  # a remote output_dir: run_dir is a local staging dir
    resume_tag, saved = _prepare_run_dir(storage, cfg.train.start, cfg.model, config_to_dict(cfg),
                                         env.rank == 0, lock)
    run_dir = storage.local
    tokenizer = load_run_tokenizer(cfg.data, cfg.model)
    cfg, model = _resolved(cfg, env)  # the run's config from here on, and its model
    if env.rank == 0:  # whole or not at all: a disk that is full keeps the config that was there
        atomic_write(RunDir(run_dir).config, lambda path: save_config(cfg, path))
    n_params = model.num_parameters()  # before ZeRO-3 partitions them to empty placeholders
    # Before the engine: ZeRO-3 then partitions the loaded weights.
    maybe_init_from(model, cfg.train, resume_tag is not None, env.rank == 0)
    # The data is opened before the engine is built: bad data stops the run in seconds.
    assert isinstance(cfg.train.batch.micro_batch_size, int)  # _resolved resolved auto
    stream = TokenStream.from_config(cfg.data, "train", cfg.train.batch.micro_batch_size, env.rank,
                                     env.world_size, cfg.train.seed, tokenizer.sha256)
    engine, ds_config = build_engine(cfg.train, cfg.run_dir, model)
    start_step, callback_states = resume_if_present(engine, run_dir, stream, resume_tag)
    if resume_tag is not None:  # the LR from this config's schedule at the resumed step
        note = follow_config_schedule(engine.lr_scheduler, cfg.train, (saved or {}).get("train"))
        if note and env.rank == 0:
            print(note, flush=True)
    if start_step > cfg.train.max_steps:  # going on would save it as step-<max_steps>, `latest`
        raise ConfigError(
            f"train.max_steps: {run_dir} resumed at step {start_step}, past train.max_steps="
            f"{cfg.train.max_steps}: raise train.max_steps to continue that run, or give this one "
            "another name or output_dir")
    if env.rank == 0:  # rows a dead run wrote past the resumed step would come twice
        cut_metrics(RunDir(run_dir).metrics, start_step)
    logger = MetricsLogger(str(run_dir), env.rank == 0, cfg.wandb, cfg.name, config_to_dict(cfg),
                           tensorboard_log_dir(cfg.tensorboard, run_dir), start_step)
    state = TrainState(cfg=cfg, env=env, run_dir=run_dir, storage=storage, engine=engine,
                       stream=stream, tokenizer=tokenizer, logger=logger,
                       faults=FaultInjector(env.rank), start_step=start_step, step=start_step,
                       last_saved=start_step if start_step else -1)
    state.summary = {"run_dir": str(run_dir), "rank": env.rank, "steps": cfg.train.max_steps,
                     "resumed_from": start_step, "first_loss": None, "final_loss": None,
                     "export_dir": None, "eval_path": None, "preempted": None}
    if env.rank == 0:
        print(f"training {cfg.name}: {n_params:,} parameters, world {env.world_size} "
              f"({env.launcher}), ZeRO-{ds_config['zero_optimization']['stage']}, "
              f"{'bf16' if ds_config['bf16']['enabled'] else 'fp32'}, "
              f"steps {start_step}..{cfg.train.max_steps}", flush=True)
        print(cfg.train.batch.batch_derivation(cfg.data.seq_len, env.world_size), flush=True)
    return state, callback_states


def _resolved(cfg: RunConfig, env: Any) -> tuple[RunConfig, Any]:
    """The run's config, built once with what this world and device decide, and its model (on
    the run's seed): model.activation_checkpointing: auto first (the model is built with it), then
    train.batch.micro_batch_size: auto by probing that model, and grad_accum_steps."""
    from scse_dist.model import LoopedLM

    model_cfg = dataclasses.replace(cfg.model, activation_checkpointing=_checkpointing(
        cfg.model, cfg.data, cfg.train, env))
    seed_everything(cfg.train.seed)
    model = LoopedLM(model_cfg)
    micro = _micro_batch(cfg.train, cfg.data, model, env)
    accum = cfg.train.batch.grad_accum_for(env.world_size, micro)
    batch = dataclasses.replace(cfg.train.batch, micro_batch_size=micro, grad_accum_steps=accum)
    train = dataclasses.replace(cfg.train, batch=batch)
    return dataclasses.replace(cfg, model=model_cfg, train=train), model


def _checkpointing(model: ModelConfig, data: DataConfig, train: TrainConfig, env: Any
                   ) -> Literal["none", "loop", "block", "auto"]:
    """model.activation_checkpointing, auto resolved by the planner's estimate
    (scse_dist.train.sizing.checkpointing_for) against this device: the share of a GPU's memory
    scse-train --plan fills, or on CPU the micro-batch finder's budget."""
    if model.activation_checkpointing != "auto":
        return model.activation_checkpointing
    from scse_dist.train.engine import resolve_precision
    from scse_dist.train.micro_batch import default_budget
    from scse_dist.train.plan import Assumptions
    from scse_dist.train.sizing import GIB, checkpointing_for

    cuda_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if torch.cuda.is_available() else None
    if cuda_memory is not None:
        budget = Assumptions().memory_fraction * cuda_memory
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or env.world_size
        budget = train.batch.micro_batch_memory_gib * GIB or default_budget(local_world)
    precision = resolve_precision(train.engine.precision)
    mode = checkpointing_for(model, data, train, env.world_size, precision, budget, cuda_memory)
    if env.rank == 0:
        print(f"model.activation_checkpointing: auto: {mode} (the planner's estimate against "
              f"{budget / GIB:.1f} GiB)", flush=True)
    return mode


def _micro_batch(train: TrainConfig, data: DataConfig, model: Any, env: Any) -> int:
    """train.batch.micro_batch_size, auto resolved by probing `model` (train.micro_batch)."""
    if isinstance(train.batch.micro_batch_size, int):
        return train.batch.micro_batch_size
    from scse_dist.train.micro_batch import find_micro_batch

    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    # Ranks of one node share its memory; unknown placement counts them all as on this node.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or env.world_size
    size, line = find_micro_batch(train, data, model, env.world_size, local_world, device)
    if env.rank == 0:
        print(line, flush=True)
    return size


def _prepare_run_dir(storage: RunStorage, start: StartConfig, model: ModelConfig, current: dict,
                     rank0: bool, lock: contextlib.ExitStack
                     ) -> tuple[Optional[str], Optional[dict]]:
    """The run dir locked, the checkpoint to resume fetched, verified and agreed: the tag and the
    config that tag saved (plan_resume, against `current`: this run's config, config_to_dict)."""
    refused: list[Any] = [None]
    if rank0:  # one rank writes the run dir and holds its lock, the others wait for it
        try:
            storage.local.mkdir(parents=True, exist_ok=True)
            # before any write: a second writer is refused here (exit 75), having changed nothing
            lock.enter_context(run_lock.held(storage.local))
        except Exception as exc:  # every rank raises it: none waits for a peer that left
            refused[0] = exc
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise refused[0]
    storage.fetch_latest()  # remote runs: the checkpoint to resume from, onto every node
    # Verified, and its config compared with this one, before anything is built or loaded; a
    # refused config leaves the run dir as it was (config.yaml included).
    fresh = not (checkpoint_dir(storage.local) / "latest").is_file()
    if start.resume == "never" or fresh:
        # a warm start's model is the export's (one that resumes ignores it)
        check_init_config(start, model)
    return plan_resume(start, current, storage.local, remote=storage.remote is not None)


def _publish_outputs(state: TrainState) -> None:
    """Rank 0, at the very end: export, eval and metrics to a remote run dir, and the last line."""
    if not state.rank0:
        return
    state.storage.upload_outputs(EXPORT_NAME, EVAL_NAME, METRICS_NAME)
    not_uploaded = state.summary.pop("not_uploaded", [])
    if not_uploaded:  # everything else is done; the checkpoint is only in staging
        kept = RunDir(state.run_dir).checkpoints
        raise OSError(f"{state.storage.remote}: checkpoint {', '.join(not_uploaded)} could not be "
                      f"uploaded (see above); it is kept in {kept}: rerun "
                      "the same command on this machine to upload it")
    eval_path = state.summary["eval_path"]
    print(f"run dir {state.run_dir}: metrics.jsonl, checkpoints/, export/ "
          f"({state.summary['export_dir']})" + (f", eval {eval_path}" if eval_path else ""),
          flush=True)

