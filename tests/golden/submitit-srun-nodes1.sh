#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=<cwd>/runs/slurm/%j/%j_0_log.err
#SBATCH --job-name=train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=<cwd>/runs/slurm/%j/%j_0_log.out
#SBATCH --partition=dev
#SBATCH --requeue
#SBATCH --signal=USR2@30
#SBATCH --time=10
#SBATCH --wckey=submitit

# setup
export OMP_NUM_THREADS=1
# Preflight checks on every node and GPU (profile doctor: false; DOCTOR=0|1 overrides).
if [[ "${DOCTOR:-0}" == 1 ]]; then
  srun --kill-on-bad-exit=1 <python> -m trainer.doctor optim.lr=0.1 \
    || { echo "preflight doctor failed (its table, or the launch error, is above): not training" >&2; exit 1; }
fi

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output <cwd>/runs/slurm/%j/%j_%t_log.out --error <cwd>/runs/slurm/%j/%j_%t_log.err --kill-on-bad-exit=1 <python> -u -m submitit.core._submit <cwd>/runs/slurm/%j
