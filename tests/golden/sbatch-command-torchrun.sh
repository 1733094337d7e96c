#!/bin/bash
# rendered from profile 'dev' by `python -m cluster submit`
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=10
# SITE
#SBATCH --partition=dev
#SBATCH --signal=USR2@30
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=runs/slurm/%x-%j.out
set -euo pipefail

export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"
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
# The ledger (python -m cluster runs): a job sbatch'ed by hand records itself once; a submitted one is there.
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then <python> -m cluster.job.ledger register "$RUN_DIR" "$@" || true; fi

# Preflight checks on every node and GPU (profile doctor: false; DOCTOR=0|1 overrides).
if [[ "${DOCTOR:-0}" == 1 ]]; then
  rc=0
  head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
  port=$(( 15000 + SLURM_JOB_ID % 15000 ))
  srun --kill-on-bad-exit=1 --label bash -c 'trap "" USR2; exec "$@"' torchrun <python> -m torch.distributed.run \
      --nnodes="$SLURM_NNODES" --nproc-per-node=1 \
      --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \
      -m trainer.doctor || rc=$?
  if (( rc )); then
    echo "preflight doctor failed (its table, or the launch error, is above)" >&2
    trap '' TERM
    verdict=0; <python> -m cluster.job.verdict --phase doctor --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
    exit "$verdict"
  fi
fi
rc=0
srun --kill-on-bad-exit=1 --label <python> -m trainer.launch --signal USR2 --torchrun 1 -- python train.py 'a b' 'x'"'"'; touch pwned; echo '"'"'y' '$(touch pwned)' '`touch pwned`' --lr=1 '*' "$@" || rc=$?

job_event job_end ", \"code\": $rc"
<python> -m trainer.report "$RUN_DIR" >/dev/null 2>&1 || true  # the attempts as this shell saw them
# Finished, preempted (saved: requeue), the user's error (stop), or the cluster's (blame, exclude, requeue).
trap '' TERM
verdict=0; <python> -m cluster.job.verdict --phase train --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
exit "$verdict"
