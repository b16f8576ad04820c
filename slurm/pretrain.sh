#!/usr/bin/env bash
# Pretraining as a plain sbatch job (scse-launch CONFIG submits the same job through submitit):
#   sbatch slurm/pretrain.sh configs/gpt2-small-scse.yaml [key.sub=value ...]
#   sbatch --nodes=4 --time=3-0 slurm/pretrain.sh configs/gpt2-small-scse.yaml name=big
# sbatch's own flags (before the script) override the defaults below; the config's resources:
# section is not read here. Each task runs the installed `python -m scse_dist.launch.run_job
# train` (one rank per task, rendezvous from Slurm's variables; no checkout needed, any submit
# directory: CONFIG and relative paths mean what they mean there). The first task schedules the
# evaluation and report jobs afterok this job. Logs: RUN/logs/<job>_<task>_log.out/.err, this
# script's own lines in RUN/logs/<job>_batch.out (slurm-scse-pretrain-<job>.out in the submit
# directory only holds an error from before the run dir is known, e.g. a bad config).
# Exit 75 (preempted: SIGUSR1 120 s before the limit, checkpoint saved) requeues the job; a crash
# is requeued by the job itself up to launch.max_retries times (docs/launching.md).
# $SCSE_PYTHON: the interpreter to run (default: python on the submitting shell's PATH).
#SBATCH --job-name=scse-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=2-00:00:00
#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
PYTHON=${SCSE_PYTHON:-python}
if [ $# -lt 1 ]; then
  echo "usage: sbatch slurm/pretrain.sh CONFIG [key.sub=value ...]" >&2
  exit 2
fi
run_dir=$("$PYTHON" -m scse_dist.launch.run_job run-dir "$@") || exit $?
mkdir -p "$run_dir/logs" || exit 66
exec >>"$run_dir/logs/${SLURM_JOB_ID}_batch.out" 2>&1
echo "pretrain.sh: job $SLURM_JOB_ID (start $((${SLURM_RESTART_COUNT:-0} + 1))) on $SLURM_JOB_NODELIST: run $run_dir"
# --kill-on-bad-exit: one rank's failure ends the others at once instead of leaving them waiting
srun --kill-on-bad-exit=1 --open-mode=append --output="$run_dir/logs/%j_%t_log.out" \
  --error="$run_dir/logs/%j_%t_log.err" \
  "$PYTHON" -u -m scse_dist.launch.run_job train "$@" --schedule-evals=slurm
status=$?
if [ "$status" -eq 75 ]; then
  echo "pretrain.sh: exit 75 (preempted and saved, or the run dir still held by another job); requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
echo "pretrain.sh: training exited $status"
exit "$status"
