#!/usr/bin/env bash
# One evaluation by hand (scse-launch schedules them by itself after training):
#   sbatch slurm/eval.sh --checkpoint runs/NAME/export --task wikitext \
#          --data wiki.test.raw --depths 1,2,4,8,16,32,48 --out runs/NAME/eval/wikitext.json
# Any scse-eval arguments pass through; --checkpoint may also be a DeepSpeed checkpoint dir.
# Then `scse-report runs/NAME --out runs/NAME/eval` rebuilds the run's report.
#SBATCH --job-name=scse-eval
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
set -euo pipefail
exec python -m scse_dist.eval.cli "$@"
