#!/usr/bin/env bash
# Multi-node pretraining: one task per GPU through srun; no ssh between nodes is needed.
#   sbatch slurm/pretrain.sh configs/gpt2-small-scse.yaml [key.sub=value ...]
# Edit the #SBATCH defaults below for your cluster, or override them on the command line
# (sbatch --nodes=4 --time=2-00:00:00 slurm/pretrain.sh ...). Submit from the repository root.
#SBATCH --job-name=scse-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
set -euo pipefail

CONFIG=${1:?usage: sbatch slurm/pretrain.sh CONFIG [key.sub=value ...]}
shift

# Rendezvous: rank 0 lives on the first host of the allocation. scse_dist.launch.distributed maps
# SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK in each task.
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

srun --kill-on-bad-exit=1 python launch/train.py --config "$CONFIG" "$@"
