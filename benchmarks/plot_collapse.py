"""Plot a run's loop diagnostics with the update sizes beside them (issue 26): what the loop keeps
of its deviation (D_kept, the core's Jacobian gain along D_0), how large each core sub-layer's
branch is against the residual it joins (|beta G(h)| / |alpha h|), and the last step's
update-to-weight ratio per parameter group, all against the training step, one row per run.

    python benchmarks/plot_collapse.py --run RUN [--run RUN2 ...] --out collapse.png [--until 200]

Reads only RUN/metrics.jsonl (rows with `diag/` keys, written every
train.callbacks.diagnostics.init_args.every_steps steps); names each row by the run directory's
name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GROUPS = ("embed", "prelude", "anchor", "core_attn", "core_mlp", "coda", "norm")


def diag_rows(run: Path, until: int) -> list[dict]:
    from scse_dist.run_dir import RunDir

    run_dir = RunDir(run)
    path = run_dir.metrics
    if not path.is_file():
        sys.exit(f"plot_collapse: {path}: no such file (is {run} a run directory?)")
    # through RunDir: a torn last line (a run killed mid-write) is skipped
    rows = [r for r in run_dir.metric_rows() if "diag/D_kept" in r and r.get("step", 0) <= until]
    if not rows:
        sys.exit(f"plot_collapse: {path}: no loop diagnostics rows (the diagnostics callback off?)")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    kept = [r for r in rows if key in r]
    return [r["step"] for r in kept], [r[key] for r in kept]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, help="a run dir (repeatable)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--until", type=int, default=10**9, help="last step shown")
    args = p.parse_args(argv)

    from scse_dist.figures import label, panels, save

    runs = [Path(r) for r in args.run]
    fig, axes = panels(len(runs), 3, 4.2, 2.8)
    for row, run in zip(axes, runs):
        rows = diag_rows(run, args.until)
        name = run.name
        ax = row[0]
        for key, text in (("diag/D_kept", "D_kept = |D_T|/|D_0|"),
                          ("diag/jacobian_gain_D0", "Jacobian gain along D_0"),
                          ("diag/anchor_over_scale", "R / rho")):
            ax.plot(*series(rows, key), label=text)
        ax.set_yscale("symlog", linthresh=0.01)
        label(ax, "step", title=f"{name}: the loop")
        ax = row[1]
        for key in sorted({k for r in rows for k in r if k.startswith("diag/branch_")}):
            ax.plot(*series(rows, key), label=key.removeprefix("diag/"))
        ax.set_yscale("log")
        label(ax, "step", "|beta G(h)| / |alpha h|", title=f"{name}: core branches")
        ax = row[2]
        for group in GROUPS:
            steps, values = series(rows, f"diag/update_ratio_{group}")
            if steps:
                ax.plot(steps, values, label=group)
        ax.set_yscale("log")
        label(ax, "step", "|dW| / |W| (last step)", title=f"{name}: update sizes")
    print(save(fig, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
