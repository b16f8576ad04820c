"""DeepSpeed engine from the run config: generated ds_config (+ optional JSON file), AdamW,
schedule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from scse_dist.param_groups import with_lr_mult
from scse_dist.run_dir import PROFILE_NAME
from scse_dist.train.config import TrainConfig
from scse_dist.train.optimizer_config import OptimizerConfig
from scse_dist.train.schedule import build_lr_scheduler
from scse_dist.typed_yaml import ConfigError, deep_merge

if TYPE_CHECKING:
    from scse_dist.model import LoopedLM

# ds_config keys that a config field decides: (path in the ds_config, the config field). A JSON
# file may repeat them only with the same value, so the YAML stays the single source of truth.
_OWNED: list[tuple[tuple[str, ...], str]] = [
    (("train_micro_batch_size_per_gpu",), "train.batch.micro_batch_size"),
    (("gradient_accumulation_steps",), "train.batch.grad_accum_steps"),
    (("gradient_clipping",), "train.optimizer.grad_clip"),
    (("zero_optimization", "stage"), "train.engine.zero_stage"),
    (("bf16", "enabled"), "train.engine.precision"),
    (("fp16", "enabled"), "train.engine.precision"),
    (("optimizer", "params", "lr"), "train.optimizer.lr"),
    (("optimizer", "params", "betas"), "train.optimizer.beta1/beta2"),
    (("optimizer", "params", "weight_decay"), "train.optimizer.weight_decay"),
    (("scheduler",), "train.optimizer.lr/train.schedule"),
]


def resolve_precision(precision: str) -> str:
    """auto -> bf16 on a CUDA device that supports it, fp32 elsewhere (CPU)."""
    if precision != "auto":
        return precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def generated_ds_config(train: TrainConfig, run_dir: str, on_cuda: bool) -> dict[str, Any]:
    """DeepSpeed's config from train.*; an optimizer section only for deepspeed_fused_adam (the
    others are built by build_optimizer and handed over as a client optimizer)."""
    opt = train.optimizer
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.batch.micro_batch_size,
        "gradient_accumulation_steps": train.batch.grad_accum_steps,
        # muon clips its AdamW groups itself (scse_dist.train.muon says why)
        "gradient_clipping": 0.0 if opt.kind == "muon" else opt.grad_clip,
        "zero_optimization": {"stage": train.engine.zero_stage},
        "bf16": {"enabled": resolve_precision(train.engine.precision) == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,  # we log ourselves (scse_dist.train.metrics)
        "wall_clock_breakdown": False,
    }
    # muon: a subclass of DeepSpeed's own Muon; update_clip: of torch's AdamW (not on its list)
    if opt.kind == "muon" or opt.update_clip:
        generated["zero_allow_untested_optimizer"] = True
    flops = flops_profiler_section(train, run_dir, on_cuda)
    if flops:
        generated["flops_profiler"] = flops
    if opt.kind == "deepspeed_fused_adam":
        if not on_cuda:
            raise ConfigError("train.optimizer.kind: deepspeed_fused_adam needs a CUDA device (it "
                              "JIT-compiles a CUDA kernel); use torch_adamw on CPU")
        generated["optimizer"] = {"type": "AdamW", "params": {
            "lr": opt.lr, "betas": [opt.beta1, opt.beta2], "weight_decay": opt.weight_decay}}
    return generated


def flops_profiler_section(train: TrainConfig, run_dir: str, on_cuda: bool
                           ) -> Optional[dict[str, Any]]:
    """DeepSpeed's flops profiler once, over the profiler callback's flops_profile_step, when
    profiling on CUDA (None otherwise). Its profile_step counts the steps done before it."""
    from scse_dist.train.callbacks.assembly import config_of

    p = config_of(train.callbacks, "profiler")
    if not (p is not None and on_cuda and p.flops_profile_step):
        return None
    step = p.flops_profile_step
    # A remote output_dir's run dir is a staging dir this function does not know: stdout then.
    output = None if "://" in run_dir else \
        str(Path(run_dir) / PROFILE_NAME / f"flops_step{step}.txt")
    return {"enabled": True, "profile_step": step - 1, "module_depth": -1, "top_modules": 3,
            "detailed": True, "output_file": output}


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def build_ds_config(train: TrainConfig, run_dir: str, on_cuda: Optional[bool] = None
                    ) -> dict[str, Any]:
    """The generated ds_config with train.engine.deepspeed_config (if any) merged over it; a
    file value that contradicts a config field is a ConfigError naming both. `run_dir`: where the
    flops profiler writes."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    generated = generated_ds_config(train, run_dir, on_cuda)
    path = train.engine.deepspeed_config
    if not path:
        return generated
    if not Path(path).is_file():
        raise ConfigError(f"train.engine.deepspeed_config: file {path!r} does not exist")
    try:
        extra = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"train.engine.deepspeed_config: {path!r} is not valid JSON: "
                          f"{exc}") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"train.engine.deepspeed_config: {path!r} must hold a JSON object")
    if "optimizer" in extra and "optimizer" not in generated:
        raise ConfigError(f"train.optimizer.kind: {path} has an 'optimizer' section, but "
                          f"train.optimizer.kind={train.optimizer.kind} builds torch's AdamW "
                          "from train.optimizer; remove the section, or set "
                          "train.optimizer.kind: deepspeed_fused_adam")
    for key_path, field_name in _OWNED:
        theirs = _get(extra, key_path)
        if theirs is _MISSING:
            continue
        ours = _get(generated, key_path)
        if ours is _MISSING or not _same(ours, theirs):
            raise ConfigError(
                f"{field_name}: the config gives {'/'.join(key_path)}="
                f"{'(none)' if ours is _MISSING else json.dumps(ours)} but {path} sets "
                f"{json.dumps(theirs)}; change one of them so they agree")
    return deep_merge(generated, extra)


def build_optimizer(opt: OptimizerConfig, model: LoopedLM,
                    on_cuda: Optional[bool] = None) -> Optional[torch.optim.Optimizer]:
    """torch.optim.AdamW over the decay/no-decay groups, fused on CUDA; Muon with AdamW for
    train.optimizer.kind: muon; None when DeepSpeed builds its own."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    if opt.kind == "muon":
        from scse_dist.train.muon import build_muon

        return build_muon(model, opt, on_cuda)
    if opt.kind != "torch_adamw":
        return None
    kwargs: dict[str, Any] = dict(lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                  weight_decay=opt.weight_decay, fused=True if on_cuda else None)
    groups = _param_groups(model, opt.weight_decay, opt.lr, opt.lr_mult)
    if opt.update_clip:
        from scse_dist.train.update_clip import UpdateClippedAdamW

        return UpdateClippedAdamW(groups, update_clip=opt.update_clip, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _param_groups(model: torch.nn.Module, weight_decay: float, lr: float,
                  lr_mult: dict[str, float]) -> list[dict[str, Any]]:
    # Decay matrices only; norms' gains and biases keep their scale (nanoGPT's split).
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    # train.optimizer.lr_mult: each split by its parameters' multipliers (lr set per group)
    return with_lr_mult(model.named_parameters(), groups, lr, lr_mult)


def require_hookable_output(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook for ZeRO-3 leaf modules: ZeRO-3 reduces a leaf's gradients in a backward hook
    torch attaches only to Tensor/tuple outputs; any other output would silently stop its weights
    training, so it fails loudly at the first forward instead."""
    if isinstance(output, torch.Tensor) or (
            isinstance(output, tuple) and all(isinstance(o, torch.Tensor) for o in output)):
        return
    raise TypeError(f"ZeRO-3 leaf module {type(module).__name__} returned {type(output).__name__}; "
                    "DeepSpeed reduces a leaf's gradients in a backward hook that fires only for a "
                    "Tensor or tuple-of-Tensors output, so its gradients would be lost. Use "
                    "train.engine.zero_stage <= 2, or make the module return tensors")


def build_engine(train: TrainConfig, run_dir: str, model: LoopedLM,
                 loop_leaf: bool = True) -> tuple[Any, dict[str, Any]]:
    """(engine, ds_config): deepspeed.initialize with our ds_config, optimizer and LR schedule,
    once the process group is up (`run_dir`: where the flops profiler writes). `loop_leaf=False`
    leaves ZeRO-3 to gather per call (for benchmarks/bench_distributed.py, to measure what the
    leaf saves)."""
    from scse_dist.quiet import name_cpu_accelerator

    name_cpu_accelerator()
    import deepspeed

    ds_config = build_ds_config(train, run_dir)
    if ds_config["zero_optimization"].get("stage", 0) == 3 and model.fixed_depth is None \
            and loop_leaf:
        from scse_dist.model import LoopCore

        # The loop reuses its block T times; as a ZeRO-3 leaf the whole loop is gathered once per
        # forward/backward whatever T is, instead of per call with a trace that a varying T breaks.
        # Not for untied: its LoopCore holds every distinct block, which would stay gathered.
        for leaf in deepspeed.utils.set_z3_leaf_modules(model, [LoopCore]):
            leaf.register_forward_hook(require_hookable_output)
    if train.engine.compile:
        # Each Block's math is compiled; as ZeRO-3 leaves, no DeepSpeed hook runs inside it.
        from scse_dist.model import Block

        model.compile_blocks()
        deepspeed.utils.set_z3_leaf_modules(model, [Block])
    opt = train.optimizer
    optimizer = build_optimizer(opt, model)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer,
        model_parameters=None if optimizer else _param_groups(
            model, opt.weight_decay, opt.lr, opt.lr_mult),
        config=ds_config, lr_scheduler=lambda opt: build_lr_scheduler(opt, train))
    if opt.kind == "muon":  # wrapped by ZeRO-1/2 or bf16: each rank holds a slice
        from scse_dist.train.muon import MuonAdamW

        assert isinstance(optimizer, MuonAdamW)  # build_optimizer's for train.optimizer.kind: muon
        optimizer.partitioned = engine.optimizer is not optimizer
    if opt.update_clip:
        _attach_update_clip(engine, optimizer)
    return engine, ds_config


def _attach_update_clip(engine: Any, optimizer: Any) -> None:
    """train.optimizer.update_clip under ZeRO-1/2: tell the clipped AdamW where each parameter lies
    in the flat partitions it steps (scse_dist.train.update_clip)."""
    from scse_dist.train.update_clip import UpdateClippedAdamW, attach_zero_layouts

    clipped = getattr(optimizer, "aux_optimizer", optimizer)  # muon's AdamW half
    assert isinstance(clipped, UpdateClippedAdamW)  # build_optimizer's under update_clip
    if engine.optimizer is optimizer:
        return  # ZeRO-0 in fp32: it steps the parameters themselves
    if not hasattr(engine.optimizer, "round_robin_bit16_groups"):
        raise ConfigError(f"train.optimizer.update_clip: DeepSpeed wrapped the optimizer in "
                          f"{type(engine.optimizer).__name__}, whose flat layout it cannot read; "
                          "use train.engine.zero_stage 1 or 2 (or stage 0 in fp32)")
    attach_zero_layouts(engine.optimizer, clipped)
