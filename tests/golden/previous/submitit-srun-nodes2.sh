#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=<cwd>/runs/slurm/%j/%j_0_log.err
#SBATCH --job-name=train
#SBATCH --nodes=2
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
export RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID} TRAINER_SIGNAL=SIGUSR2 TRAINER_SIGNAL_GRACE_S=30
mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd -P)
rm -f "$RUN_DIR/requeue.json"
# What the batch shell sees of each attempt, for the run report (trainer/report.py): one line per event.
job_event() {
  printf '{"t": %s, "event": "%s", "job_id": "%s", "restart": %s, "nodes": %s%s}\n' "$(date +%s.%N)" "$1" \
    "${SLURM_JOB_ID:-0}" "${SLURM_RESTART_COUNT:-0}" "${need:-${SLURM_JOB_NUM_NODES:-1}}" "${2:-}" \
    >> "$RUN_DIR/events.jsonl" || true
}
job_event job_start
echo "attempt ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-0} starts on ${SLURM_JOB_NODELIST:-?}" >&2
# Preflight checks on every node and GPU (profile doctor: false; DOCTOR=0|1 overrides).
if [[ "${DOCTOR:-0}" == 1 ]]; then
  rc=0
  srun --kill-on-bad-exit=1 <python> -m trainer.doctor optim.lr=0.1 || rc=$?
  if (( rc )); then
    echo "preflight doctor failed (its table, or the launch error, is above)" >&2
    trap '' TERM
    verdict=0; <python> -m cluster.verdict --phase doctor --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
    exit "$verdict"
  fi
fi

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output <cwd>/runs/slurm/%j/%j_%t_log.out --error <cwd>/runs/slurm/%j/%j_%t_log.err --kill-on-bad-exit=1 <python> -u -m submitit.core._submit <cwd>/runs/slurm/%j


# teardown
rc=$?  # the tasks' exit code (srun's, the line above)
job_event job_end ", \"code\": $rc"
# Finished, preempted (saved: requeue), the user's error (stop), or the cluster's (blame, exclude, requeue).
trap '' TERM
verdict=0; <python> -m cluster.verdict --phase train --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
exit "$verdict"