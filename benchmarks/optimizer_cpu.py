"""AdamW vs Muon on CPU: held-out loss along training, and the steps Muon needs to reach AdamW's
final held-out loss (docs/training.md has the table).

    python benchmarks/optimizer_cpu.py --out /tmp/optimizer-cpu [--variants scse,additive]
        [--adamw-lrs 3e-3,6e-3] [--muon-lrs 0.02,0.05] [--seeds 0] [--steps 300] [--every 50]
        [--micro-batch 16] [--max-batches 20]

Each run trains configs/repro-cpu.yaml's model on the quickstart data (built by the quickstart
command) as a subprocess, one at a time (ZeRO-0, warmup steps/15), keeping a checkpoint every
`--every` steps; each checkpoint's held-out loss (at the model's nominal depth) is measured
afterwards. Per variant and
optimizer the rate with the lowest final held-out loss (mean over seeds) is chosen; the summary
gives AdamW's final loss and the first checkpoint step at which Muon's held-out loss is at or
below it. Writes OUT/results.json (every curve) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_run(out: Path, name: str, variant: str, optimizer: str, lr: float, seed: int,
              args: argparse.Namespace) -> Path:
    rate = f"train.lr={lr}" if optimizer == "adamw" else f"train.muon_lr={lr}"
    overrides = [f"name={name}", f"output_dir={out}", f"model.recurrence={variant}",
                 "data.path=data/quickstart/shards", "data.tokenizer=data/quickstart/tokenizer.model",
                 f"train.optimizer={'muon' if optimizer == 'muon' else 'torch_adamw'}", rate,
                 f"train.seed={seed}", f"train.max_steps={args.steps}",
                 f"train.checkpoint_every={args.every}", "train.keep_checkpoints=100",
                 f"train.micro_batch_size={args.micro_batch}",
                 f"train.warmup_steps={max(1, args.steps // 15)}",
                 f"train.log_every={args.every}", "train.zero_stage=0"]
    run_dir = out / name
    if not (run_dir / "checkpoints" / f"step-{args.steps:07d}").is_dir():
        subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--config",
                        str(REPO / "configs" / "repro-cpu.yaml"), *overrides], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)
    return run_dir


def heldout_curve(run_dir: Path, max_batches: int) -> dict[int, float]:
    from scse_dist.eval.cli import run_heldout_eval
    from scse_dist.checkpoint.loading import load_model

    curve = {}
    for tag in sorted((run_dir / "checkpoints").glob("step-*")):
        out = run_dir / "eval" / f"{tag.name}.json"
        if out.is_file():  # measured by an earlier invocation
            rows = json.loads(out.read_text())["results"]
        else:
            model, cfg = load_model(tag)
            rows = run_heldout_eval(model, cfg, cfg.data.path, [cfg.model.depth], str(out),
                                    str(tag), max_batches)
        curve[int(tag.name.split("-")[1])] = rows[0]["loss"]
    return curve


def summarize(results: list[dict]) -> list[dict]:
    """Per variant: each optimizer's best rate (lowest mean final loss) and Muon's catch-up step."""
    rows = []
    for variant in sorted({r["variant"] for r in results}):
        best = {}
        for opt in ("adamw", "muon"):
            runs = [r for r in results if r["variant"] == variant and r["optimizer"] == opt]
            by_lr = {}
            for r in runs:
                by_lr.setdefault(r["lr"], []).append(r)
            lr = min(by_lr, key=lambda x: sum(list(r["curve"].values())[-1] for r in by_lr[x]))
            best[opt] = (lr, by_lr[lr])
        (adam_lr, adam_runs), (muon_lr, muon_runs) = best["adamw"], best["muon"]
        target = sum(list(r["curve"].values())[-1] for r in adam_runs) / len(adam_runs)
        reach = []
        for r in muon_runs:
            hit = [s for s, loss in r["curve"].items() if loss <= target]
            reach.append(min(hit) if hit else None)
        rows.append({"variant": variant, "adamw_lr": adam_lr, "muon_lr": muon_lr,
                     "adamw_final": target, "muon_final": sum(list(r["curve"].values())[-1]
                                                              for r in muon_runs) / len(muon_runs),
                     "muon_steps_to_adamw_final": reach,
                     "all_final": {f"{r['optimizer']}@{r['lr']}/s{r['seed']}":
                                   round(list(r["curve"].values())[-1], 4)
                                   for r in results if r["variant"] == variant}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="scse,additive")
    p.add_argument("--adamw-lrs", default="3e-3,6e-3")
    p.add_argument("--muon-lrs", default="0.02,0.05")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--max-batches", type=int, default=20)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    results = []
    for variant in args.variants.split(","):
        for opt, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
            for lr in map(float, lrs.split(",")):
                for seed in map(int, args.seeds.split(",")):
                    name = f"{variant}-{opt}-{lr:g}-s{seed}"
                    run_dir = train_run(out, name, variant, opt, lr, seed, args)
                    curve = heldout_curve(run_dir, args.max_batches)
                    results.append({"variant": variant, "optimizer": opt, "lr": lr, "seed": seed,
                                    "curve": curve})
                    print(name, {s: round(v, 4) for s, v in curve.items()}, flush=True)
    summary = summarize(results)
    (out / "results.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
