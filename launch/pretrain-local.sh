#!/usr/bin/env bash
# The local backend's training job (scse_dist/launch/backends/local.py runs it on this machine):
#   scse-launch configs/tiny-cpu.yaml --backend local          # train, evaluate, report
#   scse-study SPEC.yaml --backend local                         # a study's arrays, one run at a time
# It is slurm/pretrain.sh without the cluster: one process trains; then, unless
# SCSE_EVAL_IN_JOB=0 (what a study's LR-sweep runs set), every eval task and the run's report run
# here too, since the local backend runs its jobs one after another anyway. A preempted run
# (exit 75, checkpoint saved) resumes when it is submitted again.
set -euo pipefail

# Arrays: `--config-list LIST`, line SCSE_ARRAY_TASK_ID+1 of LIST is this task's config
# (optionally a tab and a job name, which only Slurm uses).
if [ "${1:-}" = "--config-list" ]; then
  IFS=$'\t' read -r listed _ < <(sed -n "$((SCSE_ARRAY_TASK_ID + 1))p" "${2:?usage: --config-list FILE}")
  set -- "$listed" "${@:3}"
fi
CONFIG=${1:?usage: launch/pretrain-local.sh CONFIG [key.sub=value ...]}
shift

PYTHON=${SCSE_PYTHON:-python}  # the local backend passes its own interpreter
EVAL_IN_JOB=${SCSE_EVAL_IN_JOB:-1}
# evaluated below: the trainer's own held-out evaluation after training would repeat it
[ "$EVAL_IN_JOB" = 1 ] && after_train=eval.after_train=false || after_train=

status=0
"$PYTHON" -m scse_dist.train.cli --config "$CONFIG" "$@" $after_train || status=$?
if [ "$status" = 0 ] && [ "$EVAL_IN_JOB" = 1 ]; then
  "$PYTHON" -m scse_dist.launch.scheduler "$CONFIG" "$@" --evaluate || status=$?
fi
exit "$status"
