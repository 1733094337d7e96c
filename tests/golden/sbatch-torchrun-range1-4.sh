#!/bin/bash
# rendered from profile 'dev' by `python -m cluster submit`
#SBATCH --job-name=train
#SBATCH --nodes=1-4
#SBATCH --cpus-per-task=2
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
export TRAINER_IN_PLACE=1
export TRAINER_NODES=1-4
export RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID} TRAINER_SIGNAL=SIGUSR2 TRAINER_SIGNAL_GRACE_S=30
mkdir -p "$RUN_DIR" && RUN_DIR=$(cd "$RUN_DIR" && pwd -P)
rm -f "$RUN_DIR/requeue.json"
# What the batch shell sees of each attempt, for the run report (trainer/report.py): one line per event.
job_event() {
  printf '{"t": %s, "event": "%s", "job_id": "%s", "restart": %s, "nodes": %s%s}\n' "$(date +%s.%N)" "$1" \
    "${SLURM_JOB_ID:-0}" "${SLURM_RESTART_COUNT:-0}" "${need:-${SLURM_JOB_NUM_NODES:-1}}" "${2:-}" \
    >> "$RUN_DIR/events.jsonl" || true
}
# The ledger (python -m cluster runs): a job sbatch'ed by hand records itself once; a submitted one is there.
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then <python> -m cluster.job.ledger register "$RUN_DIR" "$@" || true; fi

for arg in "$@"; do
  if [[ $arg == run.dir=* ]]; then echo "error: run.dir: set RUN_DIR=… instead (watched here)" >&2; exit 2; fi
done
# Restarts in place (spare_nodes: 0, nodes: 1-4): each attempt runs on up to 4 of the allocation's nodes, at least 1;
# after a failure the verdict may start the next one here at once, on the nodes it names.
# (sed, not head: it reads every name, so scontrol never dies of SIGPIPE under pipefail)
here=0 step_nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "1,4p" | paste -sd, -)
while :; do
  rm -f "$RUN_DIR/requeue.json"  # only this attempt's marker may count
  TRAINER_ATTEMPT=${SLURM_RESTART_COUNT:-0}
  if (( here )); then TRAINER_ATTEMPT+=".$here"; fi
  export TRAINER_ATTEMPT
  need=$(( $(tr -cd , <<<"$step_nodes" | wc -c) + 1 ))
  job_event job_start ", \"attempt\": \"$TRAINER_ATTEMPT\", \"step_nodes\": \"$step_nodes\""
  echo "attempt $TRAINER_ATTEMPT of job $SLURM_JOB_ID starts on $step_nodes" >&2
  # Preflight checks on every node and GPU (profile doctor: true; DOCTOR=0|1 overrides).
  if [[ "${DOCTOR:-1}" == 1 ]]; then
    rc=0
    head=${step_nodes%%,*}
    port=$(( 15000 + SLURM_JOB_ID % 15000 ))
    srun --kill-on-bad-exit=1 --label --nodes="$need" --nodelist="$step_nodes" --ntasks=$(( need * 1 )) --ntasks-per-node=1 --cpus-per-task=2 bash -c 'trap "" USR2; exec "$@"' torchrun <python> -m torch.distributed.run \
        --nnodes="$need" --nproc-per-node=2 \
        --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \
        -m trainer.doctor optim.lr=0.1 'run.name=a'"'"'; touch pwned; echo '"'"'x' 'run.name="$(touch pwned)"' 'run.name=a b;c|d`touch pwned`' "$@" || rc=$?
    if (( rc )); then
      echo "preflight doctor failed (its table, or the launch error, is above)" >&2
      trap '' TERM
      verdict=0; next=$(<python> -m cluster.job.verdict --phase doctor --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 --min-nodes 1 --in-place --least 1 --most 4) || verdict=$?
      if [[ ${next##*$'\n'} == restart-here:* ]]; then step_nodes=$(sed -n 's/^step-nodes: //p' <<<"$next") h=$(sed -n 's/^here: //p' <<<"$next") here=${h:-$(( here + 1 ))}; trap - TERM; continue; fi
      exit "$verdict"
    fi
  fi
  rc=0
  head=${step_nodes%%,*}
  port=$(( 15000 + SLURM_JOB_ID % 15000 ))
  srun --kill-on-bad-exit=1 --label --nodes="$need" --nodelist="$step_nodes" --ntasks=$(( need * 1 )) --ntasks-per-node=1 --cpus-per-task=2 bash -c 'trap "" USR2; exec "$@"' torchrun <python> -m torch.distributed.run \
      --nnodes="$need" --nproc-per-node=2 \
      --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \
      -m trainer optim.lr=0.1 'run.name=a'"'"'; touch pwned; echo '"'"'x' 'run.name="$(touch pwned)"' 'run.name=a b;c|d`touch pwned`' "$@" || rc=$?

  job_event job_end ", \"code\": $rc"
  # Finished, preempted (saved: requeue), the user's error (stop), or the cluster's (blame, exclude, requeue).
  trap '' TERM
  verdict=0; next=$(<python> -m cluster.job.verdict --phase train --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 --min-nodes 1 --in-place --least 1 --most 4) || verdict=$?
  if [[ ${next##*$'\n'} == restart-here:* ]]; then step_nodes=$(sed -n 's/^step-nodes: //p' <<<"$next") h=$(sed -n 's/^here: //p' <<<"$next") here=${h:-$(( here + 1 ))}; trap - TERM; continue; fi
  exit "$verdict"
done
