#!/bin/bash
# rendered from profile 'dev' by `python -m cluster submit`
#SBATCH --job-name=train
#SBATCH --nodes=3
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
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then PYTHONPATH="${SLURM_SUBMIT_DIR:-$PWD}" python3 -m cluster.job.ledger register "$RUN_DIR" "$@" || true; fi

for arg in "$@"; do
  if [[ $arg == run.dir=* ]]; then echo "error: run.dir: set RUN_DIR=… instead (watched here)" >&2; exit 2; fi
done
# Preflight checks on every node and GPU (profile doctor: true; DOCTOR=0|1 overrides).
if [[ "${DOCTOR:-1}" == 1 ]]; then
  rc=0
  srun --kill-on-bad-exit=1 --label <cwd>/containers/docker-task.sh -v "$RUN_DIR:$RUN_DIR" -- trainer:1 python3 -m trainer.doctor optim.lr=0.1 'run.name=a'"'"'; touch pwned; echo '"'"'x' 'run.name="$(touch pwned)"' 'run.name=a b;c|d`touch pwned`' "$@" || rc=$?
  if (( rc )); then
    echo "preflight doctor failed (its table, or the launch error, is above)" >&2
    trap '' TERM
    verdict=0; PYTHONPATH="${SLURM_SUBMIT_DIR:-$PWD}" python3 -m cluster.job.verdict --phase doctor --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
    if (( verdict == 126 || verdict == 127 )); then
      echo "no python3 on this host for the verdict: the plain requeue rule" >&2
      [[ $rc -eq 75 || -f "$RUN_DIR/requeue.json" ]] && { grep -qs '"signal": "deadline"' "$RUN_DIR/requeue.json" || (( ${SLURM_RESTART_COUNT:-0} < 3 )); } && scontrol requeue "$SLURM_JOB_ID" && exit 0
      exit "$rc"
    fi
    exit "$verdict"
  fi
fi
rc=0
# The job's store in a process of its own (profile regroup: true): when a rank is lost, the others regroup on
# it and go on in their processes; srun keeps the step (--kill-on-bad-exit=0), the verdict reads every rank.
# A warm spare is started on the lost rank's node (if it still runs processes) and joins at a step boundary.
on_lost='TRAINER_SPARE=$(( 1000 + TRAINER_REPLACEMENT )) srun --overlap --kill-on-bad-exit=0 --label --nodes=1 --ntasks=1 --nodelist="$TRAINER_LOST_NODE" <cwd>/containers/docker-task.sh -v "$RUN_DIR:$RUN_DIR" -- trainer:1 python3 -m trainer optim.lr=0.1 '"'"'run.name=a'"'"'"'"'"'"'"'"'; touch pwned; echo '"'"'"'"'"'"'"'"'x'"'"' '"'"'run.name="$(touch pwned)"'"'"' '"'"'run.name=a b;c|d`touch pwned`'"'"''$( (( $# == 0 )) || printf ' %q' "$@")
# A rank the others' hang watchdogs find stuck is killed on its node, and they go on without it.
on_hang='srun --overlap --nodes=1 --ntasks=1 --nodelist="$TRAINER_HUNG_NODE" kill -KILL "$TRAINER_HUNG_PID"'
unset TRAINER_STORE; export TRAINER_MAX_FAILURES=3
store_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
store_file="$RUN_DIR/.store-${TRAINER_ATTEMPT:-${SLURM_RESTART_COUNT:-0}}" && rm -f "$store_file"{,.live}
# The store runs in the image, which has no srun: its actions go to the host through a FIFO (none: no store).
actions="$store_file.actions" && rm -f "$actions" && store_pid="" actions_pid=""
if mkfifo "$actions"; then
  PYTHONPATH="${SLURM_SUBMIT_DIR:-$PWD}" python3 -m trainer.store --actions-from "$actions" --on-lost "$on_lost" --on-hang "$on_hang" >> "$RUN_DIR/store.log" 2>&1 &
  actions_pid=$!
  <cwd>/containers/docker-task.sh -v "$RUN_DIR:$RUN_DIR" -- trainer:1 python3 -m trainer.store --port-file "$store_file" --live-file "$store_file.live" --host-name "$store_host" --actions-to "$actions" >> "$RUN_DIR/store.log" 2>&1 &
  store_pid=$!
fi
for _ in $(seq 600); do [[ -s $store_file || -z $store_pid ]] && break; sleep 0.1; done
if read -r store_port presence_port 2>/dev/null < "$store_file"; then
  export TRAINER_STORE="$store_host:$store_port:$presence_port"
else
  echo "note: the job's store did not start ($RUN_DIR/store.log): a lost rank restarts the attempt" >&2
fi
srun --kill-on-bad-exit=0 --label <cwd>/containers/docker-task.sh -v "$RUN_DIR:$RUN_DIR" -- trainer:1 python3 -m trainer optim.lr=0.1 'run.name=a'"'"'; touch pwned; echo '"'"'x' 'run.name="$(touch pwned)"' 'run.name=a b;c|d`touch pwned`' "$@" || rc=$?

# srun's step ends with its own tasks, but spares that took lost ranks' places may train on: while the store
# counts processes training, the attempt goes on
while [[ -n ${store_pid:-} && $(cat "$store_file.live" 2>/dev/null) =~ ^[1-9] ]] && kill -0 "$store_pid" 2>/dev/null; do sleep 0.2; done
[[ -z ${store_pid:-} ]] || kill "$store_pid" 2>/dev/null || true  # the attempt's store
[[ -z ${actions_pid:-} ]] || { kill "$actions_pid" 2>/dev/null || true; rm -f "$actions"; }  # its actions' runner
job_event job_end ", \"code\": $rc"
# Finished, preempted (saved: requeue), the user's error (stop), or the cluster's (blame, exclude, requeue).
trap '' TERM
verdict=0; PYTHONPATH="${SLURM_SUBMIT_DIR:-$PWD}" python3 -m cluster.job.verdict --phase train --rc "$rc" --max-requeues 3 --max-failures 3 --suspect-hours 24 || verdict=$?
if (( verdict == 126 || verdict == 127 )); then
  echo "no python3 on this host for the verdict: the plain requeue rule" >&2
  [[ $rc -eq 75 || -f "$RUN_DIR/requeue.json" ]] && { grep -qs '"signal": "deadline"' "$RUN_DIR/requeue.json" || (( ${SLURM_RESTART_COUNT:-0} < 3 )); } && scontrol requeue "$SLURM_JOB_ID" && exit 0
  exit "$rc"
fi
exit "$verdict"
