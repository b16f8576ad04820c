"""GPU check in one command, within a time budget: everything the first GPU hour must measure.

    python benchmarks/gpu_check.py --prepare-data .gpu_check_data   # here, once: the tiny corpus
    python benchmarks/gpu_check.py --data .gpu_check_data --out $OUT  # one H100/H200: <= 8 min
    python benchmarks/gpu_check.py --cpu --out DIR                    # the same stages, toy size

Stages, in this order, each in a process of its own with a time limit (a stage that fails or runs
out of time keeps what it recorded, and its log; the next stage runs regardless):
  versions       python, torch, CUDA, DeepSpeed, the device; the bf16 matmul ceiling (TFLOP/s)
  bug_probes     flex attention in a compiled block against SDPA (logits, gradients); the
                 micro-batch finder under bf16 autocast (learned-anchor SCSE)
  eager_zero1    configs/gpt2-small-scse.yaml trained through the real trainer: tokens/s, MFU,
                 peak memory against the planner's estimate (scse-train --plan's numbers)
  compiled_loop  train.engine.compile with loop checkpointing, and a one-step profiler table
  compiled_none  train.engine.compile without checkpointing
  zero3          ZeRO-3, eager
  document_mask  model.document_mask against the causal eager_zero1
  generation     greedy and speculative decoding (KV cache)
In-process stages live in gpu_check_probes.py. Under --out: summary.json (every stage's numbers,
status and wall time; rewritten after each stage), profile.txt (compiled_loop's table) and
gpu_check-files.tar.gz (every stage's log and result, every run's metrics.jsonl and
config.yaml): few files, so that all of them come back from a device machine. --cpu runs the
same stages at toy sizes on CPU (tests/test_gpu_check.py keeps it alive) and writes the same keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt2-small-scse.yaml"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout, without PYTHONPATH

# (stage, seconds on GPU, seconds on CPU): the GPU limits sum to 465 s, inside 8 minutes with
# the wheels' install; most stages end well before theirs. On CPU a trainer stage is mostly its
# process's start (DeepSpeed's import): 15-40 s on a shared 2-core machine.
STAGES = [("versions", 30, 30), ("bug_probes", 60, 60), ("eager_zero1", 70, 60),
          ("compiled_loop", 75, 90), ("compiled_none", 70, 90), ("zero3", 60, 60),
          ("document_mask", 60, 60), ("generation", 40, 30)]
TRAIN_STAGES = {  # the overrides each trainer stage adds to the common ones
    "eager_zero1": ["train.engine.compile=false"],
    "compiled_loop": ["train.engine.compile=true", "model.activation_checkpointing=loop",
                      "train.callbacks.profiler.enabled=true"],
    "compiled_none": ["train.engine.compile=true", "model.activation_checkpointing=none"],
    "zero3": ["train.engine.compile=false", "train.engine.zero_stage=3"],
    "document_mask": ["train.engine.compile=false", "model.document_mask=true"],
}
TRAIN_KEYS = ["steps_logged", "first_loss", "last_loss", "skipped_steps", "tokens_per_s", "mfu",
              "averaged_steps", "peak_mem_gib", "compile", "loop_checkpointing"]
EXTRA_KEYS = {"eager_zero1": ["planned_peak_gib", "planned_micro_batch"],
              "compiled_loop": ["profile_table"], "document_mask": ["tokens_per_s_vs_causal"]}
def stage_keys(name: str) -> set[str]:
    """Every key a stage's row of summary.json holds, on GPU and with --cpu alike."""
    from gpu_check_probes import KEYS

    own = KEYS[name] if name in KEYS else TRAIN_KEYS + EXTRA_KEYS.get(name, [])
    return {"status", "wall_s", *own}


SUMMARY_KEYS = ["device", "torch", "cpu", "budget_s", "data", "overrides", "stages", "ok",
                "failures", "wall_s"]

# micro-batch 16 x 1 accumulation of 1024 tokens per step on one GPU; the config's sampled T.
GPU_OVERRIDES = ["train.batch.global_batch_tokens=0", "train.batch.micro_batch_size=16",
                 "train.batch.grad_accum_steps=1", "train.engine.precision=bf16",
                 "train.schedule.warmup_steps=5", "train.max_steps=30", "train.log_every=5"]
# d 64, 2 heads, seq 64, the tokenizer's vocabulary, micro-batch 2 x accum 2, fp32, T <= 4
CPU_OVERRIDES = ["model.d_model=64", "model.n_heads=2", "model.max_seq_len=64", "data.seq_len=64",
                 "train.batch.global_batch_tokens=0", "train.batch.micro_batch_size=2",
                 "train.batch.grad_accum_steps=2", "train.engine.precision=fp32",
                 "train.optimizer.lr=3e-3",
                 "train.schedule.warmup_steps=1", "train.depth.max=4",
                 "train.depth.backprop_steps=2", "train.max_steps=4", "train.log_every=2"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="toy sizes on CPU (the slow tier runs it)")
    p.add_argument("--out", default=str(REPO / "runs" / "gpu_check"),
                   help="summary.json, profile.txt, gpu_check-files.tar.gz "
                   "(default runs/gpu_check)")
    p.add_argument("--workdir", default=None,
                   help="stage logs and runs (default: a new temporary folder)")
    p.add_argument("--data", default=None, help="a built data dir (shards/, tokenizer.model); "
                   "default: built from the stdlib's docstrings in the workdir")
    p.add_argument("--prepare-data", metavar="DIR", default=None,
                   help="build the tiny corpus into DIR (to carry to a GPU machine) and exit")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all stages (default 465 on GPU, 420 with --cpu)")
    p.add_argument("--stages", default=",".join(name for name, _, _ in STAGES),
                   help="comma-separated subset, in the order above")
    p.add_argument("--run-stage", default=None, help=argparse.SUPPRESS)  # a child's one stage
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all: a temporary name, renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def build_data(root: Path, vocab: int) -> Path:
    """The tiny corpus (shards/ + tokenizer.model: the quickstart's stdlib docstrings) in root."""
    from scse_dist.data.config import DataConfig
    from scse_dist.data.quickstart import ensure_data

    ensure_data(DataConfig(path=str(root / "shards"), tokenizer=str(root / "tokenizer.model"),
                           build="stdlib_docs", build_vocab_size=vocab, heldout_fraction=0.05))
    return root


def child_env(cpu: bool) -> dict[str, str]:
    """A stage's environment: this checkout first on PYTHONPATH (kept if set), no launcher
    variables inherited; --cpu: the CPU path even on a GPU machine, compiled with aot_eager
    (inductor compiles slowly on CPU)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "benchmarks")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("SCSE_COMPILE_BACKEND", "aot_eager")
    return env


def run_child(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> str:
    """'ok', 'failed (exit N)' or 'timeout after N s'; stdout and stderr to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the trainer's children go with it
            proc.wait()
            return f"timeout after {timeout:.0f} s"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def steady_state(rows: list[dict], warm_steps: int) -> tuple[float, float | None, str]:
    """tokens/s and MFU over the logged windows that start after `warm_steps`, weighted by time.

    Each row covers the steps since the previous row; the first rows hold compile and warm-up.
    Falls back to the last window when no window starts that late.
    """
    windows = [(prev["step"] if prev else 0, row) for prev, row in zip([None] + rows, rows)]
    kept = [(start, row) for start, row in windows if start >= warm_steps] or windows[-1:]
    seconds = [row["step_time_s"] * (row["step"] - start) for start, row in kept]
    tokens_per_s = sum(r["tokens_per_s"] * s for (_, r), s in zip(kept, seconds)) / sum(seconds)
    mfu = None if kept[0][1]["mfu"] is None else \
        sum(r["mfu"] * s for (_, r), s in zip(kept, seconds)) / sum(seconds)
    return tokens_per_s, mfu, f"{kept[0][0] + 1}-{kept[-1][1]['step']}"


def train_measures(run_dir: Path, steps: int) -> dict[str, Any]:
    """A trainer run's numbers from its metrics.jsonl: whatever it logged, finished or not."""
    import yaml

    result: dict[str, Any] = dict.fromkeys(TRAIN_KEYS)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()
            if line.strip()] if metrics.exists() else []
    rows = [r for r in rows if "loss" in r]
    if (run_dir / "config.yaml").exists():
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())  # what the trainer ran
        result.update(compile=resolved["train"]["engine"]["compile"],
                      loop_checkpointing=resolved["model"]["activation_checkpointing"] == "loop")
    if rows:
        tokens_per_s, mfu, averaged = steady_state(rows, warm_steps=max(1, steps // 3))
        result.update(steps_logged=rows[-1]["step"], first_loss=rows[0]["loss"],
                      last_loss=rows[-1]["loss"], skipped_steps=rows[-1]["skipped_steps"],
                      tokens_per_s=tokens_per_s, mfu=mfu, averaged_steps=averaged,
                      peak_mem_gib=max((r.get("peak_mem_gib") or 0.0 for r in rows),
                                       default=0.0) or None)
    return result


def planned(overrides: list[str]) -> dict[str, Any]:
    """The planner's peak memory and micro-batch for this run on one H100 (scse-train --plan)."""
    from scse_dist.config import load_config
    from scse_dist.train.plan import Assumptions, build
    from scse_dist.train.sizing import GIB

    plan = build(load_config(str(CONFIG), overrides), 1, Assumptions(gpu="h100"))
    return {"planned_peak_gib": plan["memory_bytes"]["peak"] / GIB,
            "planned_micro_batch": plan["micro_batch"]}


def train_stage(name: str, common: list[str], work: Path, out: Path, timeout: float,
                env: dict[str, str], steps: int) -> dict[str, Any]:
    """One trainer process (`python launch/train.py`) of gpt2-small-scse plus `name`'s overrides."""
    overrides = common + [f"name={name}", f"output_dir={work / 'runs'}"] + TRAIN_STAGES[name]
    if name == "compiled_loop":  # the profiler's table of the last step but one
        profiler = "train.callbacks.profiler.init_args"
        overrides += [f"{profiler}.start_step={steps - 1}", f"{profiler}.steps=1"]
    stage = int(next((o.split("=")[1] for o in overrides
                      if o.startswith("train.engine.zero_stage=")), 1))
    overrides.append(f"train.engine.deepspeed_config={REPO / 'configs' / 'deepspeed'}/"
                     f"zero{stage}.json")
    cmd = [sys.executable, "launch/train.py", "--config", str(CONFIG), *overrides]
    status = run_child(cmd, work / "logs" / f"{name}.log", timeout, env)
    result = {"status": status, **train_measures(work / "runs" / name, steps)}
    result.update(dict.fromkeys(EXTRA_KEYS.get(name, [])))
    if name == "eager_zero1":
        result.update(planned(overrides))
    if name == "compiled_loop":
        tables = sorted((work / "runs" / name / "profile").glob("rank0.steps*.txt"))
        if tables:
            shutil.copyfile(tables[-1], out / "profile.txt.tmp")
            os.replace(out / "profile.txt.tmp", out / "profile.txt")
            result["profile_table"] = "profile.txt"
    return result


def probe_stage(name: str, work: Path, timeout: float, env: dict[str, str], cpu: bool
                ) -> dict[str, Any]:
    """One stage of gpu_check_probes in a child; what it recorded before it ended."""
    from gpu_check_probes import KEYS

    result_path = work / "stages" / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__)), "--run-stage", name, "--result", str(result_path)]
    status = run_child(cmd + ["--cpu"] * cpu, work / "logs" / f"{name}.log", timeout, env)
    recorded = json.loads(result_path.read_text()) if result_path.exists() else {}
    return {"status": status, **dict.fromkeys(KEYS[name]), **recorded}


def run_one_stage(name: str, result: Path, cpu: bool) -> int:
    """The child's side: run `name`, rewriting `result` after each number."""
    from gpu_check_probes import STAGES as PROBES

    recorded: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        recorded[key] = value
        write_json(result, recorded)
        print(f"{name}: {key} = {value}", flush=True)

    PROBES[name](record, cpu, CONFIG)
    return 0


def failures_of(stages: dict[str, dict]) -> list[str]:
    """One line per stage that did not end well, or whose numbers say a bug is back."""
    lines = [f"{name}: {r['status']}" for name, r in stages.items() if r["status"] != "ok"]
    for name, r in stages.items():
        if name in TRAIN_STAGES and r["status"] == "ok" and r["skipped_steps"]:
            lines.append(f"{name}: {r['skipped_steps']} non-finite step(s) skipped")
    probes = stages.get("bug_probes", {})
    for key in ("flex_logits_max_abs", "flex_grad_max_abs"):
        value = probes.get(key)
        if value is not None and value > 1e-3:  # fp32 both: summation order only
            lines.append(f"bug_probes: {key} {value:.3g} (flex in a compiled block is not SDPA)")
    if probes and probes.get("finder_error"):
        lines.append(f"bug_probes: micro-batch finder under autocast: {probes['finder_error']}")
    return lines


def bundle(work: Path, out: Path) -> None:
    """Every log, stage result and run's metrics.jsonl and config.yaml, in one archive."""
    tmp = out / "gpu_check-files.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for pattern in ("logs/*.log", "stages/*.json", "runs/*/metrics.jsonl",
                        "runs/*/config.yaml", "runs/*/profile/*.txt"):
            for path in sorted(work.glob(pattern)):
                tar.add(path, arcname=str(path.relative_to(work)))
    os.replace(tmp, out / "gpu_check-files.tar.gz")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_stage:
        return run_one_stage(args.run_stage, Path(args.result), args.cpu)
    if args.prepare_data:
        print(f"tiny corpus in {build_data(Path(args.prepare_data).resolve(), 4096)}")
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu for the CPU path", file=sys.stderr)
        return 2
    started = time.perf_counter()
    budget = args.budget or (420.0 if args.cpu else 465.0)
    out = Path(args.out).resolve()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check-")).resolve()
    for folder in (out, work / "logs", work / "stages"):
        folder.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(wanted) - {name for name, _, _ in STAGES})
    if unknown:
        print(f"gpu_check: --stages: unknown {', '.join(unknown)}", file=sys.stderr)
        return 2
    data = Path(args.data).resolve() if args.data else build_data(work / "data",
                                                                   512 if args.cpu else 4096)
    from scse_dist.data.tokenizer import Tokenizer

    vocab = Tokenizer.load(str(data / "tokenizer.model")).vocab_size
    common = [f"data.path={data / 'shards'}", f"data.tokenizer={data / 'tokenizer.model'}",
              "train.checkpoint.every=100000", "train.checkpoint.keep=1",
              "eval.after_train=false", "wandb.enabled=false"] + \
        ([f"model.vocab_size={vocab}"] + CPU_OVERRIDES if args.cpu else GPU_OVERRIDES)
    steps = int(next(o.split("=")[1] for o in common if o.startswith("train.max_steps=")))
    env = child_env(args.cpu)
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    summary: dict[str, Any] = {"device": device, "torch": torch.__version__, "cpu": args.cpu,
                               "budget_s": budget, "data": str(data), "overrides": common,
                               "stages": {}, "ok": False, "failures": [], "wall_s": None}
    print(f"gpu_check: {device}, torch {torch.__version__}, budget {budget:.0f} s, "
          f"work {work}, out {out}", flush=True)
    for name, gpu_limit, cpu_limit in STAGES:
        if name not in wanted:
            continue
        left = budget - (time.perf_counter() - started)
        limit = min(cpu_limit if args.cpu else gpu_limit, left)
        stage_start = time.perf_counter()
        if limit < 5:
            result: dict[str, Any] = {**dict.fromkeys(stage_keys(name)),
                                      "status": "skipped: the budget is spent"}
        elif name in TRAIN_STAGES:
            result = train_stage(name, common, work, out, limit, env, steps)
        else:
            result = probe_stage(name, work, limit, env, args.cpu)
        result["wall_s"] = round(time.perf_counter() - stage_start, 1)
        if name == "document_mask" and "eager_zero1" in summary["stages"]:
            causal = summary["stages"]["eager_zero1"]["tokens_per_s"]
            if causal and result["tokens_per_s"]:
                result["tokens_per_s_vs_causal"] = result["tokens_per_s"] / causal
        summary["stages"][name] = result
        summary["failures"] = failures_of(summary["stages"])
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        write_json(out / "summary.json", summary)
        bundle(work, out)
        print(f"== {name}: {json.dumps(result)}", flush=True)
    summary["ok"] = not summary["failures"]
    write_json(out / "summary.json", summary)
    print(f"summary -> {out / 'summary.json'} ({summary['wall_s']} s)", flush=True)
    if summary["failures"]:
        print(f"gpu_check: FAILED: {'; '.join(summary['failures'])}", file=sys.stderr)
        return 1
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
