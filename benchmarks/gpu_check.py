"""GPU check in one command: train GPT-2-small SCSE at ZeRO-1 and ZeRO-3, check, measure, evaluate.

    python benchmarks/gpu_check.py                        # one H100/H200, bf16: a few minutes
    python benchmarks/gpu_check.py --steps 20 --stages 3  # a shorter rerun of one stage
    python benchmarks/gpu_check.py --cpu                  # the same path at tiny sizes (CI)

Builds its data offline (the quickstart's stdlib-docstring corpus; a 4096-piece tokenizer, which
model.vocab_size 32000 covers) once under --workdir, then trains configs/gpt2-small-scse.yaml
(loop checkpointing, sampled T, torch.compile where the config has it) through the real trainer,
one `python launch/train.py` subprocess per ZeRO stage. Per run it checks that no step was
skipped as non-finite and that the loss fell, and reports tokens/s and MFU averaged over the
steps after the first third (compile and warm-up excluded), peak GPU memory, and held-out
perplexity at depths 1, 4 and 32 (the trainer's after-training evaluation). Prints a table,
writes it as JSON (--out), and exits 1 with a one-line reason if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpt2-small-scse.yaml"
EVAL_DEPTHS = [1, 4, 32]


@dataclasses.dataclass
class Profile:
    """What differs between the GPU check and its tiny CPU twin; everything else is one code
    path."""
    vocab: int  # tokenizer pieces (model.vocab_size stays the config's 32000 on GPU)
    overrides: list[str]
    steps: int
    log_every: int
    min_loss_drop: float  # nats the last logged loss must fall below the first


# One GPU steps 64 sequences (micro 16 x accum 4, what the config stepped per GPU before its
# batch became 0.5M tokens over any world size: 32 accumulations on one GPU would not fit 200 s).
GPU = Profile(vocab=4096, steps=30, log_every=5, min_loss_drop=1.0, overrides=[
    "train.global_batch_tokens=65536", "train.precision=bf16", "train.optimizer.lr=6e-4",
    "train.schedule.warmup_steps=5",
    "eval.batch_size=16", "eval.max_batches=4"])
# d 64, 2 heads, seq 64, the tokenizer's vocabulary, micro-batch 2 x accum 2, fp32. Six steps
# claim only a small drop (measured: 6.25 -> 6.01 on the 512-piece stdlib corpus).
CPU = Profile(vocab=512, steps=6, log_every=2, min_loss_drop=0.1, overrides=[
    "model.d_model=64", "model.n_heads=2", "model.max_seq_len=64",
    "data.seq_len=64", "train.global_batch_tokens=0", "train.micro_batch_size=2",
    "train.grad_accum_steps=2",
    "train.precision=fp32", "train.optimizer.lr=3e-3", "train.schedule.warmup_steps=1",
    "eval.batch_size=2", "eval.max_batches=2"])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="tiny sizes on CPU (CI keeps this path alive)")
    p.add_argument("--workdir", default=str(REPO / "runs" / "gpu_check"),
                   help="data (built once, reused), runs and logs; default runs/gpu_check")
    p.add_argument("--data", default=None,
                   help="a built data dir (shards/, tokenizer.model) to use")
    p.add_argument("--out", default=None, help="summary JSON (default: WORKDIR/gpu_check.json)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 30; --cpu 6)")
    p.add_argument("--stages", default="1,3", help="ZeRO stages to run, e.g. 1,3 or 3")
    p.add_argument("--timeout", type=int, default=200,
                   help="seconds per training run (2 x 200 s keeps the check under 8 minutes)")
    return p.parse_args(argv)


def compile_supported() -> bool:
    # train.compile lands separately; pass it only once TrainConfig has the field.
    from scse_dist.config import TrainConfig
    return "compile" in {f.name for f in dataclasses.fields(TrainConfig)}


def build_data(workdir: Path, vocab: int, heldout_fraction: float, data: str | None) -> Path:
    """The data dir (shards/ + tokenizer.model): `data` if given, else built once under workdir."""
    from scse_dist.config import DataConfig
    from scse_dist.data.quickstart import ensure_data

    root = Path(data) if data else workdir / f"data-vocab{vocab}"
    ensure_data(DataConfig(path=str(root / "shards"), tokenizer=str(root / "tokenizer.model"),
                           build=None if data else "stdlib_docs", build_vocab_size=vocab,
                           heldout_fraction=heldout_fraction))
    return root


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


def run_stage(stage: int, common: list[str], workdir: Path, steps: int, timeout: int,
              env: dict) -> dict:
    """Train one ZeRO stage in a fresh process; return its row of the summary ('failure' if any)."""
    name = f"gpu-check-zero{stage}"
    run_dir = workdir / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # never resume an earlier check's checkpoint
    cmd = [sys.executable, "launch/train.py", "--config", str(CONFIG), *common, f"name={name}",
           f"output_dir={workdir / 'runs'}", f"train.zero_stage={stage}",
           f"train.deepspeed_config={REPO / 'configs' / 'deepspeed' / f'zero{stage}.json'}"]
    log = workdir / f"{name}.log"
    print(f"\n== ZeRO-{stage}: {' '.join(cmd[1:])}\n   log: {log}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout} s"
    result: dict = {"stage": stage, "wall_s": round(time.perf_counter() - start, 1),
                    "log": str(log)}
    if rc != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-15:] or [""]
        print("\n".join(tail))
        return {**result, "failure": f"ZeRO-{stage}: trainer exited with {rc}: "
                                     f"{tail[-1].strip()[:300]} (log {log})"}

    from scse_dist.run_dir import RunDir
    from scse_dist.train.metrics import format_line

    run = RunDir(run_dir)
    rows = run.metric_rows()
    print("".join(f"   {format_line(row)}\n" for row in rows), end="")  # the trainer's own lines
    tokens_per_s, mfu, averaged = steady_state(rows, warm_steps=max(1, steps // 3))
    heldout = json.loads(run.results("heldout").read_text())["results"]
    resolved = yaml.safe_load(run.config.read_text())  # what the trainer ran
    result.update(
        compile=resolved["train"].get("compile", False),
        loop_checkpointing=resolved["model"]["activation_checkpointing"] == "loop",
        windows=[{k: r.get(k)
                  for k in ("step", "loss", "depth", "tokens_per_s", "mfu", "peak_mem_gib")}
                 for r in rows],
        first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
        skipped_steps=rows[-1]["skipped_steps"],
        tokens_per_s=tokens_per_s, mfu=mfu, averaged_steps=averaged,
        peak_mem_gib=max((r.get("peak_mem_gib") or 0.0 for r in rows), default=0.0) or None,
        ppl={str(r["depth"]): r["ppl"] for r in heldout})
    return result


def check(result: dict, min_loss_drop: float) -> str | None:
    """The one-line reason this run fails the check, or None."""
    if "failure" in result:
        return result["failure"]
    stage, first, last = result["stage"], result["first_loss"], result["last_loss"]
    if result["skipped_steps"]:
        return f"ZeRO-{stage}: {result['skipped_steps']} non-finite step(s) skipped"
    if not (math.isfinite(first) and math.isfinite(last)) or last > first - min_loss_drop:
        return f"ZeRO-{stage}: loss {first:.3f} -> {last:.3f} did not fall by {min_loss_drop} nats"
    if not all(v is not None and math.isfinite(v) for v in result["ppl"].values()):
        return f"ZeRO-{stage}: held-out perplexity not finite: {result['ppl']}"
    return None


def table(results: list[dict]) -> str:
    head = ["ZeRO", "steps avg", "tok/s", "MFU", "peak GiB", "loss first->last"] + \
        [f"ppl@{d}" for d in EVAL_DEPTHS] + ["wall s"]
    lines = [" | ".join(head)]
    for r in results:
        if "failure" in r:
            lines.append(f"{r['stage']} | failed: {r['failure']}")
            continue
        lines.append(" | ".join([
            str(r["stage"]), r["averaged_steps"], f"{r['tokens_per_s']:,.0f}",
            "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}",
            f"{r['first_loss']:.3f}->{r['last_loss']:.3f}",
            *(f"{r['ppl'].get(str(d)) or float('nan'):.1f}" for d in EVAL_DEPTHS),
            str(r["wall_s"])]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # this checkout's scse_dist, for the parent and the runs
    import torch

    profile = CPU if args.cpu else GPU
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu for the CPU path", file=sys.stderr)
        return 2
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out or workdir / "gpu_check.json")
    steps = args.steps or profile.steps
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    use_compile = not args.cpu and compile_supported()  # compiling costs more than tiny CPU runs
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check: {device}, torch {torch.__version__}, ZeRO stages {stages}, {steps} steps, "
          f"compile {'on' if use_compile else 'off'}"
          + ("" if args.cpu or use_compile else " (this checkout has no train.compile)")
          + f", workdir {workdir}", flush=True)

    data = build_data(workdir, profile.vocab, heldout_fraction=0.05, data=args.data)
    from scse_dist.data.tokenizer import Tokenizer
    vocab = Tokenizer.load(str(data / "tokenizer.model")).vocab_size
    common = [f"data.path={data / 'shards'}", f"data.tokenizer={data / 'tokenizer.model'}"] + \
        (["model.vocab_size=" + str(vocab)] if args.cpu else []) + profile.overrides + [
        f"train.max_steps={steps}", f"train.log_every={profile.log_every}",
        f"train.checkpoint_every={steps}", "train.keep_checkpoints=1",
        "model.activation_checkpointing=loop", f"eval.depths=[{','.join(map(str, EVAL_DEPTHS))}]",
        "eval.after_train=true", "wandb.enabled=false"] + \
        (["train.compile=true"] if use_compile else [])
    # One process of its own per run: no launcher variables inherited from whoever started us.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)]
                                        + [env["PYTHONPATH"]] * bool(env.get("PYTHONPATH")))
    if args.cpu:  # the CPU path even on a GPU machine; one thread: tiny ops, shared cores
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        env.setdefault("OMP_NUM_THREADS", "1")

    results = [run_stage(stage, common, workdir, steps, args.timeout, env) for stage in stages]
    failures = [reason for reason in (check(r, profile.min_loss_drop) for r in results) if reason]
    summary = {"device": device, "torch": torch.__version__, "compile": use_compile,
               "config": str(CONFIG.relative_to(REPO)), "overrides": common, "steps": steps,
               "eval_depths": EVAL_DEPTHS, "runs": results,
               "ok": not failures, "failures": failures}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{device}, compile {'on' if use_compile else 'off'}, loop checkpointing, "
          f"{steps} steps; tok/s and MFU averaged over 'steps avg'\n{table(results)}\n"
          f"summary -> {out_path}", flush=True)
    if failures:
        print(f"gpu_check: FAILED: {'; '.join(failures)}", file=sys.stderr)
        return 1
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
