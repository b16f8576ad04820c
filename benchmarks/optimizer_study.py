"""Tokens to reach a baseline optimizer's final validation loss, from a finished scse-study.

    python benchmarks/optimizer_study.py studies/muon-d128 [--pairs scse_muon:scse,...]
        [--validation data/eval/owt-valid.txt] [--max-batches N]

The study (research/specs/muon-d128.yaml) keeps a checkpoint every 50 steps of every final run.
This scores each checkpoint on the validation corpus (the study's lr.validation: never a test
set) at the run's training depth, once (cached as eval/validation-step-<k>.json in the run dir),
and compares each candidate variant with its baseline seed by seed:

- the baseline's final validation loss L (its last checkpoint);
- the tokens the candidate needs to reach L: the first step its curve is at or below L,
  interpolated linearly between the two checkpoints around the crossing ("not reached" when it
  never is);
- tokens saved = the baseline's tokens minus those, and the final-loss difference; means with
  a 95% t interval over seeds (scse_dist.study.stats).

Default pairs: every variant named <name>_muon against <name>. Prints a markdown table and writes
<study>/optimizer_study.json (every curve and the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from scse_dist.config import load_saved_config
from scse_dist.run_dir import RunDir, is_complete
from scse_dist.study.stats import t_interval


def validation_curve(run_dir: Path, validation: str, max_batches: int) -> dict[int, float]:
    """step -> validation loss at model.depth, for every kept checkpoint of a run (each scored
    once; a score a Ctrl-C left partial is scored again)."""
    from scse_dist.checkpoint.loading import load_model
    from scse_dist.eval.task_run import run_task

    curve = {}
    run = RunDir(run_dir)
    for tag in sorted(run.checkpoints.glob("step-*")):
        step = int(tag.name.split("-")[1])
        out = run.results(f"validation-step-{step}")
        if not is_complete(out):
            model, cfg = load_model(tag)
            run_task("heldout", model, cfg, validation, [cfg.model.depth], str(out),
                     checkpoint_label=f"{tag} (validation)",
                     max_batches=max_batches or cfg.eval.max_batches, progress=False)
        curve[step] = json.loads(out.read_text())["results"][0]["loss"]
    return curve


def steps_to_reach(curve: dict[int, float], target: float) -> float | None:
    """The first step at which the curve is at or below `target`, linear between checkpoints."""
    prev = None
    for step, loss in sorted(curve.items()):
        if loss <= target:
            if prev is None:
                return float(step)
            s0, l0 = prev  # l0 > target >= loss
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def interval(values: list[float]) -> dict:
    iv = t_interval(values)
    return {"mean": iv.mean, "low": iv.low, "high": iv.high}


def interval_cell(iv: dict | None) -> str:
    if iv is None:
        return "n/a"
    if iv["low"] is None:
        return f"{iv['mean']:.4g}"
    return f"{iv['mean']:.4g} [{iv['low']:.4g}, {iv['high']:.4g}]"


def compare(runs: dict, candidate: str, baseline: str, tokens_per_step: dict) -> dict:
    seeds = sorted(set(runs[candidate]) & set(runs[baseline]))
    per_seed = []
    for seed in seeds:
        cand, base = runs[candidate][seed], runs[baseline][seed]
        last = max(base)
        target = base[last]
        reach = steps_to_reach(cand, target)
        base_tokens = last * tokens_per_step[baseline]
        reach_tokens = None if reach is None else reach * tokens_per_step[candidate]
        per_seed.append({"seed": seed, "baseline_final_loss": target,
                         "candidate_final_loss": cand[max(cand)],
                         "baseline_tokens": base_tokens, "candidate_tokens_to_reach": reach_tokens,
                         "tokens_saved": None if reach_tokens is None
                         else base_tokens - reach_tokens})
    reached = [r["tokens_saved"] for r in per_seed if r["tokens_saved"] is not None]
    diffs = [r["candidate_final_loss"] - r["baseline_final_loss"] for r in per_seed]
    summary = {"candidate": candidate, "baseline": baseline, "seeds": per_seed,
               "all_reached": len(reached) == len(per_seed)}
    if per_seed and summary["all_reached"]:
        summary["tokens_saved"] = interval(reached)
        summary["token_ratio"] = [r["candidate_tokens_to_reach"] / r["baseline_tokens"]
                                  for r in per_seed]
    if per_seed:
        summary["final_loss_difference"] = interval(diffs)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="a study dir (its runs.json, study.yaml)")
    p.add_argument("--pairs", default="", help="candidate:baseline,... (default: X_muon:X)")
    p.add_argument("--validation", default="", help="default: the study's lr.validation")
    p.add_argument("--max-batches", type=int, default=0, help="0: the runs' eval.max_batches")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    study = Path(args.study)
    if not (study / "runs.json").is_file():
        print(f"optimizer_study: {study}/runs.json not found: run the study first", file=sys.stderr)
        return 2
    spec = yaml.safe_load((study / "study.yaml").read_text())
    validation = args.validation or (spec.get("lr") or {}).get("validation")
    if not validation:
        print("optimizer_study: the study has no lr.validation; pass --validation", file=sys.stderr)
        return 2
    runs: dict[str, dict[int, dict[int, float]]] = {}
    tokens_per_step: dict[str, int] = {}
    for record in json.loads((study / "runs.json").read_text()):
        if record["stage"] != "final":
            continue
        run_dir = Path(record["run_dir"])
        if not RunDir(run_dir).checkpoints.is_dir():
            print(f"optimizer_study: {run_dir} has no checkpoints; skipped", file=sys.stderr)
            continue
        cfg = load_saved_config(record["config"])  # one rank per run (a CPU study)
        tokens_per_step[record["variant"]] = (cfg.train.batch.micro_batch_size
                                              * cfg.train.batch.grad_accum_steps * cfg.data.seq_len)
        curve = validation_curve(run_dir, validation, args.max_batches)
        runs.setdefault(record["variant"], {})[record["seed"]] = curve
        print(f"{run_dir.name}: " + " ".join(f"{s}:{v:.3f}" for s, v in sorted(curve.items())),
              flush=True)
    if args.pairs:
        pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
    else:
        pairs = [(v, v.removesuffix("_muon")) for v in runs
                 if v.endswith("_muon") and v.removesuffix("_muon") in runs]
    summaries = [compare(runs, c, b, tokens_per_step) for c, b in pairs]
    print("\n| candidate | baseline | seeds | baseline final loss | candidate final loss | "
          "tokens to reach (share of baseline's) | tokens saved, mean [95%] "
          "| final loss diff [95%] |")
    print("|---|---|---:|---|---|---|---|---|")
    for s in summaries:
        rows = s["seeds"]
        reach = ", ".join("not reached" if r["candidate_tokens_to_reach"] is None else
                          f"{r['candidate_tokens_to_reach']:,.0f} "
                          f"({r['candidate_tokens_to_reach'] / r['baseline_tokens']:.2f})"
                          for r in rows)
        base_final = ", ".join(f"{r['baseline_final_loss']:.3f}" for r in rows)
        cand_final = ", ".join(f"{r['candidate_final_loss']:.3f}" for r in rows)
        print(f"| {s['candidate']} | {s['baseline']} | {len(rows)} | {base_final} | {cand_final} | "
              f"{reach} | {interval_cell(s.get('tokens_saved'))} | "
              f"{interval_cell(s.get('final_loss_difference'))} |")
    (study / "optimizer_study.json").write_text(json.dumps(
        {"validation": validation,
         "curves": {v: {str(s): c for s, c in by.items()} for v, by in runs.items()},
         "comparisons": summaries}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
