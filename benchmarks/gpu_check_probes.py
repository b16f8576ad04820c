"""The in-process stages of benchmarks/gpu_check.py: versions and the bf16 matmul ceiling, the two
bug probes (flex attention in a compiled block against SDPA; the micro-batch finder under bf16
autocast), and greedy and speculative generation.

Each stage is `stage(record, cpu, config)` (`config`: the GPU run's config file, whose model
generation times on GPU): it runs in a child process of its own (gpu_check.py bounds its
time) and hands each number to `record(key, value)` as soon as it has it, so a stage that runs
out of time still leaves what it measured. A failing measure records its error as one line under
`<key>_error` and the stage goes on. KEYS lists every key each stage records, on GPU and CPU alike
(None where a measure does not apply: a CPU has no CUDA version).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

Record = Callable[[str, Any], None]

KEYS = {
    "versions": ["python", "torch", "cuda", "deepspeed", "device", "matmul_n",
                 "bf16_matmul_tflops"],
    "bug_probes": ["compile_backend", "flex_logits_max_abs", "flex_grad_max_abs",
                   "flex_grad_error", "flex_error", "finder_micro_batch", "finder_error"],
    "generation": ["depth", "new_tokens", "greedy_tokens_per_s", "speculative_tokens_per_s",
                   "draft_depth", "accepted_per_drafted", "speculative_equals_greedy"],
}


def _device(cpu: bool) -> torch.device:
    return torch.device("cpu") if cpu else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"


def versions(record: Record, cpu: bool, config: Path) -> None:
    device = _device(cpu)
    record("python", platform.python_version())
    record("torch", torch.__version__)
    record("cuda", None if cpu else torch.version.cuda)
    try:  # the version without the import's seconds
        record("deepspeed", importlib.metadata.version("deepspeed"))
    except importlib.metadata.PackageNotFoundError as exc:  # the trainer stages will fail
        record("deepspeed", _error(exc))
    record("device", "cpu" if cpu else torch.cuda.get_device_name(device))
    n = 256 if cpu else 8192  # 8192^3 reaches the H100's plateau (KINDS.md: 769-798 TFLOP/s)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    _sync(device)
    record("matmul_n", n)
    record("bf16_matmul_tflops", 2 * n**3 * reps / (time.perf_counter() - started) / 1e12)


def _model_cfg(cpu: bool, **model: Any):
    from scse_dist.config import config_from_dict

    width = {"d_model": 64, "n_heads": 2} if cpu else {"d_model": 256, "n_heads": 4}
    return config_from_dict({"name": "probe", "model": {
        "vocab_size": 512, "max_seq_len": 128, "n_prelude": 1, "n_core": 1, "n_coda": 1,
        "recurrence": "scse", "depth": 3, **width, **model}, "data": {"seq_len": 128}})


def _flex_vs_sdpa(record: Record, device: torch.device) -> None:
    """Logits and gradients of a model whose blocks are compiled, attending within documents
    through flex, against the same weights uncompiled through the SDPA mask (fp32 both)."""
    from scse_dist.model import LoopedLM
    from scse_dist.model.documents import BACKEND_ENV, document_ids

    torch.manual_seed(0)
    reference = LoopedLM(_model_cfg(device.type == "cpu", document_mask=True).model).to(device)
    compiled = copy.deepcopy(reference)
    compiled.compile_blocks()
    tokens = torch.randint(1, 512, (2, 129), generator=torch.Generator().manual_seed(1))
    tokens[:, ::37] = 0  # eos id 0: four or five documents per row
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    doc = document_ids(inputs, 0)
    runs = (("sdpa", reference, "sdpa"), ("flex", compiled, "flex"))
    try:
        with torch.no_grad():  # flex has no backward on CPU: the logits first, without one
            logits = {}
            for name, model, backend in runs:
                os.environ[BACKEND_ENV] = backend
                logits[name] = model(inputs, depth=3, document_ids=doc).logits
        record("flex_logits_max_abs", (logits["flex"] - logits["sdpa"]).abs().max().item())
        try:
            for _, model, backend in runs:
                os.environ[BACKEND_ENV] = backend
                model(inputs, targets, depth=3, document_ids=doc).loss.backward()
            record("flex_grad_max_abs", max(
                (a.grad - b.grad).abs().max().item()
                for a, b in zip(compiled.parameters(), reference.parameters())))
        except Exception as exc:
            record("flex_grad_error", _error(exc))
    finally:
        os.environ.pop(BACKEND_ENV, None)


def _finder_under_autocast(record: Record, device: torch.device) -> None:
    """train.batch.micro_batch_size: auto's finder for the learned-anchor SCSE config in bf16. On
    CUDA the whole finder (its probe enters autocast itself); on CPU, where the probe turns autocast
    off, the probe's forward and backward at 2 sequences under CPU autocast entered here."""
    from scse_dist.model import LoopedLM
    from scse_dist.train.micro_batch import find_micro_batch

    cfg = _model_cfg(device.type == "cpu", anchor="learned")  # deeploop: a Post-LN core
    batch = dataclasses.replace(cfg.train.batch, micro_batch_size="auto", global_batch_size=8)
    engine = dataclasses.replace(cfg.train.engine, precision="bf16")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch=batch, engine=engine))
    model = LoopedLM(cfg.model)
    if device.type == "cuda":
        record("finder_micro_batch", find_micro_batch(cfg.train, cfg.data, model, 1, 1, device)[0])
        return
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
    with torch.autocast("cpu", torch.bfloat16):
        model(tokens[:, :-1], tokens[:, 1:], depth=3, backprop_steps=2,
              keep_logits=False).loss.backward()
    record("finder_micro_batch", 2)


def bug_probes(record: Record, cpu: bool, config: Path) -> None:
    device = _device(cpu)
    record("compile_backend", os.environ.get("SCSE_COMPILE_BACKEND", "inductor"))
    # the finder first: it takes seconds, the compile of flex most of the stage
    for probe, key in ((_finder_under_autocast, "finder_micro_batch"),
                       (_flex_vs_sdpa, "flex_logits_max_abs")):
        try:
            probe(record, device)
        except Exception as exc:
            record(key.split("_")[0] + "_error", _error(exc))


def generation(record: Record, cpu: bool, config: Path) -> None:
    """Greedy and speculative decoding (KV cache) of random-weight models at the GPU config's
    size (bf16) or the toy size (fp32): tokens/s, and whether greedy speculation gave greedy's
    tokens."""
    from scse_dist.generate import generate
    from scse_dist.generate.speculative import speculative_generate
    from scse_dist.model import LoopedLM

    device = _device(cpu)
    if cpu:
        model_cfg = _model_cfg(True).model
    else:
        from scse_dist.config import load_config
        model_cfg = load_config(str(config), []).model  # the GPU config's model, random weights
    torch.manual_seed(0)
    model = LoopedLM(model_cfg).to(device, torch.float32 if cpu else torch.bfloat16).eval()
    prompts = torch.randint(1, model_cfg.vocab_size, (4, 32),
                            generator=torch.Generator().manual_seed(2)).tolist()
    new, depth, draft_depth = (16 if cpu else 64), 4, 1
    record("depth", depth)
    record("new_tokens", new)
    record("draft_depth", draft_depth)
    timed = {}
    with torch.no_grad():
        for name, run in (("greedy", lambda: generate(model, prompts, max_new_tokens=new,
                                                      depth=depth)),
                          ("speculative", lambda: speculative_generate(
                              model, prompts, max_new_tokens=new, draft_depth=draft_depth,
                              depth=depth))):
            run()  # warm-up: kernels, allocator
            _sync(device)
            started = time.perf_counter()
            timed[name] = run()
            _sync(device)
            record(f"{name}_tokens_per_s",
                   len(prompts) * new / (time.perf_counter() - started))
    spec = timed["speculative"].speculation
    record("accepted_per_drafted", spec["accepted"] / max(1, spec["drafted"])
           if isinstance(spec, dict) else None)
    record("speculative_equals_greedy", timed["speculative"].tokens == timed["greedy"].tokens)


STAGES = {"versions": versions, "bug_probes": bug_probes, "generation": generation}
