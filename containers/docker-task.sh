#!/usr/bin/env bash
# One Slurm task inside Docker (or podman): `srun containers/docker-task.sh [DOCKER_RUN_OPTION...] -- IMAGE CMD...`
# (options such as `-v /data:/data`; CONTAINER_ENGINE=podman switches the engine).
# Docker's containers escape Slurm's process tracking (scancel would leave them running), so this
# wrapper names its container, forwards Slurm's signals into it, and removes it however it ends.
set -euo pipefail
opts=()
while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
[[ $# -ge 2 ]] || { echo "usage: $0 [docker run options] -- IMAGE CMD..." >&2; exit 2; }
shift
image=$1
shift
engine=${CONTAINER_ENGINE:-docker}
# The batch shell has no step id: its container (the job's store) must not take the name of step 0's first task, nor
# that of the attempt before (whose wrapper may still be removing its own).
name="train-${SLURM_JOB_ID:-0}-${SLURM_STEP_ID:-batch${TRAINER_ATTEMPT:+-$TRAINER_ATTEMPT}}-${SLURM_PROCID:-0}"

# A container's /etc/hosts is the engine's, not this node's: hand the trainer addresses, not node names.
address() {  # address VARIABLE HOST: HOST's IPv4 address as this node resolves it, or exit 2 naming VARIABLE
    getent ahostsv4 "$2" | awk 'NR == 1 {print $1}' ||
        { echo "error: $1: node $2 does not resolve on $(hostname)" >&2; exit 2; }
}
if [[ -z ${MASTER_ADDR:-} && -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
    head=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | head -n 1)
    MASTER_ADDR=$(address MASTER_ADDR "$head")
    export MASTER_ADDR
fi
if [[ -n ${TRAINER_STORE:-} ]]; then  # the job's store: HOST:PORT:PORT
    TRAINER_STORE="$(address TRAINER_STORE "${TRAINER_STORE%%:*}"):${TRAINER_STORE#*:}"
fi

# What the trainer reads to find its place (trainer/core/env.py TRAINER_VARIABLES; a test keeps the lists equal),
# what its exit records name (trainer/core/exits.py EXIT_VARIABLES: the node and the attempt),
# plus what NCCL, CUDA and W&B need. `-e NAME` copies the value from here without writing it down.
vars=(RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
      TORCHELASTIC_RESTART_COUNT
      SLURM_PROCID SLURM_LOCALID SLURM_NTASKS SLURM_NODEID SLURM_NNODES SLURM_JOB_NODELIST SLURM_STEP_NODELIST
      SLURM_STEP_NUM_NODES SLURM_JOB_ID SLURM_STEP_ID SLURM_NTASKS_PER_NODE SLURM_STEP_TASKS_PER_NODE
      SLURM_TASKS_PER_NODE SLURM_JOB_NAME SLURM_ARRAY_JOB_ID SLURM_ARRAY_TASK_ID SLURM_RESTART_COUNT
      SLURM_GPUS_ON_NODE WANDB_API_KEY TRAINER_FAULTS RUN_DIR TRAINER_SIGNAL TRAINER_CHECKSUM TRAINER_MTBF_HOURS
      TRAINER_SIGNAL_GRACE_S TRAINER_TRIAL TRAINER_PRUNING TRAINER_IN_PLACE TRAINER_NODES TRAINER_MEMORY_DIR SLURM_JOB_END_TIME
      TRAINER_STORE TRAINER_SPARE TRAINER_MAX_FAILURES SLURMD_NODENAME TRAINER_ATTEMPT WANDB_MODE WANDB_PROJECT CUDA_VISIBLE_DEVICES OMP_NUM_THREADS PYTHONUNBUFFERED)
env_args=()
for v in "${vars[@]}"; do
    if [[ -n ${!v+x} ]]; then env_args+=(-e "$v"); fi
done
while IFS= read -r v; do env_args+=(-e "$v"); done < <(compgen -e | grep -E '^(NCCL_|SUBMITIT_)' || true)
gpu_args=()
if [[ -n ${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}} ]]; then
    # The GPUs Slurm gave this job (host indices), not all of the node's: jobs may share a node.
    gpu_args=(--gpus "\"device=${SLURM_STEP_GPUS:-$SLURM_JOB_GPUS}\"")
elif [[ ${SLURM_GPUS_ON_NODE:-0} != 0 ]]; then
    gpu_args=(--gpus all)
fi

# A job that regroups in place (TRAINER_STORE) kills a stuck rank by the process id the rank reports, on its node:
# the container shares the host's process ids then. Its init is then no PID 1, and says so unless it is a subreaper.
pid_args=()
if [[ -n ${TRAINER_STORE:-} ]]; then pid_args=(--pid=host -e TINI_SUBREAPER=1); fi

# A container left by a task that was SIGKILLed (its EXIT trap never ran) would block the name.
"$engine" rm -f "$name" >/dev/null 2>&1 || true

# The working folder is mounted at the same path, so relative run folders and logs land on the host.
# The engine's init (tini) passes a signal to its child only; TINI_KILL_PROCESS_GROUP makes it signal the child's
# whole process group, as Slurm does outside a container (a command under `python -m trainer.launch` gets it too).
"$engine" run --rm --init -e TINI_KILL_PROCESS_GROUP=1 --name "$name" --network host --ipc=host "${pid_args[@]}" "${gpu_args[@]}" \
    --user "$(id -u):$(id -g)" -e HOME=/tmp -v "$PWD:$PWD" -w "$PWD" "${opts[@]}" \
    "${env_args[@]}" --entrypoint "" "$image" "$@" &
child=$!

# shellcheck disable=SC2317  # called from traps
forward() { "$engine" kill --signal="$1" "$name" >/dev/null 2>&1 || true; }
# shellcheck disable=SC2317
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; }
trap 'forward USR1' USR1
trap 'forward USR2' USR2
trap 'forward TERM' TERM
trap 'forward INT' INT
trap cleanup EXIT

# `wait` returns early when a trapped signal arrives: keep waiting until the container has gone.
rc=0
while kill -0 "$child" 2>/dev/null; do
    wait "$child" || rc=$?
done
exit "$rc"
