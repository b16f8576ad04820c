#!/usr/bin/env bash
# Multi-node pretraining, then evaluation and a report with nobody watching the queue.
#   sbatch slurm/pretrain.sh configs/gpt2-small-scse.yaml [key.sub=value ...]
# (or `scse-launch configs/gpt2-small-scse.yaml [...]`, which runs this sbatch for you).
# Edit the #SBATCH defaults below for your cluster, or override them on the command line
# (sbatch --nodes=4 --time=2-00:00:00 slurm/pretrain.sh ...). Submit from the repository root,
# with the project's Python environment active (the job inherits it).
#
# What happens:
# 1. On the job's first start, `scse-launch --after-job $SLURM_JOB_ID` submits one evaluation job
#    per `eval.tasks` and a report job, all with --dependency=afterok on this job: they run only
#    if training succeeds. A requeued start (SLURM_RESTART_COUNT > 0) skips this, and scse-launch
#    also records the job id in RUN/eval/scheduled.json, so evaluations are never submitted twice.
# 2. One task per GPU through srun; no ssh between nodes is needed.
# 3. Preemption: Slurm sends SIGUSR1 to the training tasks 120 s before the time limit
#    (--signal=USR1@120); they finish the step, save a checkpoint and exit 75. This script then
#    requeues the job (--requeue allows it), and the next start resumes from the checkpoint.
#    Set SCSE_SCHEDULE_EVALS=0 to train without scheduling evaluations.
# 4. SCSE_EVAL_IN_JOB=1 (what scse-study sets): after training succeeded, every eval task and the
#    run's report run here, in this job's allocation, instead of as separate jobs.
#SBATCH --job-name=scse-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
set -euo pipefail

# Job arrays (scse-study): `sbatch --array=0-N%P slurm/pretrain.sh --config-list LIST`, where
# line i+1 of LIST is the config of array task i, optionally a tab and the job name it takes
# (the array's tasks share one name until they start; then squeue shows what each one runs).
if [ "${1:-}" = "--config-list" ]; then
  IFS=$'\t' read -r listed name < <(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "${2:?usage: --config-list FILE}")
  set -- "$listed" "${@:3}"
  # ARRAY_ID_TASK names this task alone (one task's SLURM_JOB_ID equals the array's id, and
  # updating that id renames every task of the array)
  if [ -n "${name:-}" ]; then
    scontrol update JobId="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" JobName="$name" || true
  fi
fi
CONFIG=${1:?usage: sbatch slurm/pretrain.sh CONFIG [key.sub=value ...]}
shift
REQUEUE_EXIT_CODE=75  # scse_dist.train.faults: preempted, checkpoint saved, rerun to resume

if [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && [ "${SCSE_SCHEDULE_EVALS:-1}" = 1 ]; then
  python -m scse_dist.launch.scheduler "$CONFIG" "$@" --after-job "$SLURM_JOB_ID"
fi

# Rendezvous: rank 0 lives on the first host of the allocation. scse_dist.distributed maps
# SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK in each
# task of the srun step below (SLURM_STEP_NUM_TASKS: the step's tasks; this batch shell, which is
# no step, has only SLURM_NTASKS, so a python run here directly would be rank 0 of 1).
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

status=0
srun --kill-on-bad-exit=1 python launch/train.py --config "$CONFIG" "$@" || status=$?
if [ "$status" = "$REQUEUE_EXIT_CODE" ]; then
  echo "pretrain.sh: training was preempted and saved a checkpoint; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
if [ "$status" = 0 ] && [ "${SCSE_EVAL_IN_JOB:-0}" = 1 ]; then
  python -m scse_dist.launch.scheduler "$CONFIG" "$@" --evaluate || status=$?
fi
exit "$status"
