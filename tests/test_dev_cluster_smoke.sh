#!/usr/bin/env bash
# Smoke test of slurm/dev-cluster.sh: brings up its own 2-node cluster, runs real jobs through it,
# and takes it down again. Needs root (the cluster's daemons run as root); prints "SKIP" and
# exits 0 otherwise. Takes about a minute (a DDP training run on 2 nodes included when .venv
# exists; SMOKE_TRAIN=0 leaves it out).
#
#   tests/test_dev_cluster_smoke.sh
#
# The cluster lives in its own folder (DEV_CLUSTER_DIR, default ${TMPDIR:-/tmp}/slurm-ddp-smoke),
# so a developer's cluster in the default folder is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="$ROOT/slurm/dev-cluster.sh"
PY="$ROOT/.venv/bin/python"
export DEV_CLUSTER_DIR="${DEV_CLUSTER_DIR:-${TMPDIR:-/tmp}/slurm-ddp-smoke}"

if [[ "$(id -u)" != 0 ]]; then
    echo "SKIP: $0 needs root"
    exit 0
fi

WORK="$(mktemp -d)"
failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

cleanup() {
    "$CLUSTER" down >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# Waits (up to $1 s) until job $2 has left the queue.
wait_job() {
    local deadline=$((SECONDS + $1))
    while [[ -n "$(squeue -h -j "$2" 2>/dev/null)" ]]; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# Prints the job's state from accounting, retrying while slurmdbd catches up.
acct_state() {
    local state="" i
    for i in $(seq 20); do
        state="$(sacct -j "$1" -X -n -P -o State 2>/dev/null | head -1)"
        [[ -n "$state" && "$state" != RUNNING && "$state" != PENDING ]] && break
        sleep 0.5
    done
    echo "$state"
}

# --- up -------------------------------------------------------------------------------------
start=$SECONDS
"$CLUSTER" up
echo "up took $((SECONDS - start)) s"
eval "$("$CLUSTER" env)"
cd "$WORK"

"$CLUSTER" up 2>&1 | grep -q "already up" && pass "second up says already up" || fail "second up"
"$CLUSTER" status >/dev/null && pass "status exits 0" || fail "status"

states="$(sinfo -h -N -o '%N %T' | sort -u | tr '\n' ' ')"
[[ "$states" == "n1 idle n2 idle " ]] && pass "sinfo: $states" || fail "sinfo: '$states'"

# --- steps: ranks, node names resolvable inside the job ---------------------------------------
out="$(srun -N2 -n2 bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME $(getent hosts n1 | cut -d" " -f1)"' | sort)"
[[ "$out" == $'0 n1 127.0.0.1\n1 n2 127.0.0.1' ]] && pass "srun -N2: ranks on n1, n2; n1 resolves" ||
    fail "srun -N2 gave: $out"

# --- sbatch + accounting; SLURM_STEP_ID in the batch shell and in a step ----------------------
id="$(sbatch --parsable -N2 --ntasks-per-node=1 -o "$WORK/env-%j.out" --wrap \
    'echo "batch STEP_ID=${SLURM_STEP_ID-unset}"; srun bash -c "echo step STEP_ID=\${SLURM_STEP_ID-unset}"')"
wait_job 60 "$id" || fail "job $id did not finish"
state="$(acct_state "$id")"
[[ "$state" == COMPLETED ]] && pass "sacct: job $id $state" || fail "sacct: job $id '$state'"
grep -qx 'batch STEP_ID=unset' "$WORK/env-$id.out" && pass "batch shell has no SLURM_STEP_ID" ||
    fail "batch shell: $(grep batch "$WORK/env-$id.out")"
[[ "$(grep -c -x 'step STEP_ID=0' "$WORK/env-$id.out")" == 2 ]] && pass "srun step: SLURM_STEP_ID=0 on both ranks" ||
    fail "steps: $(grep step "$WORK/env-$id.out" | tr '\n' ' ')"

# --- requeue: the job starts again with SLURM_RESTART_COUNT=1 ---------------------------------
id="$(sbatch --parsable --requeue --open-mode=append -o "$WORK/rq-%j.out" \
    --wrap 'echo "restart=${SLURM_RESTART_COUNT:-0}"; sleep 60')"
deadline=$((SECONDS + 30))
until [[ "$(squeue -h -j "$id" -o %T)" == RUNNING ]] && grep -q restart=0 "$WORK/rq-$id.out" 2>/dev/null; do
    ((SECONDS < deadline)) || break
    sleep 0.5
done
scontrol requeue "$id"
t0=$SECONDS
until grep -q restart=1 "$WORK/rq-$id.out" 2>/dev/null; do
    ((SECONDS - t0 < 40)) || break
    sleep 0.5
done
if grep -q restart=1 "$WORK/rq-$id.out" 2>/dev/null; then
    pass "requeued job restarted with SLURM_RESTART_COUNT=1 after $((SECONDS - t0)) s"
else
    fail "requeued job did not restart: $(tr '\n' ' ' <"$WORK/rq-$id.out")"
fi
scancel "$id"

# --- a real 2-node DDP run of the trainer ------------------------------------------------------
if [[ "${SMOKE_TRAIN:-1}" != 0 && -x "$PY" ]]; then
    id="$(sbatch --parsable -N2 --ntasks-per-node=1 -D "$ROOT" -o "$WORK/train-%j.out" --wrap \
        "srun $PY -m trainer data.synthetic_train_size=1024 train.epochs=1 data.num_workers=0 run.dir=$WORK/run")"
    wait_job 300 "$id" || fail "training job $id did not finish in 300 s"
    if grep -q "2 process(es) via slurm" "$WORK/train-$id.out" && grep -q "done: test accuracy" "$WORK/train-$id.out"; then
        pass "2-node DDP training: $(grep 'done:' "$WORK/train-$id.out" | cut -c1-40)"
    else
        fail "2-node DDP training; output:"
        cat "$WORK/train-$id.out"
    fi

    # --- submitit sees the cluster through PATH and SLURM_CONF -----------------------------------
    if "$PY" -c 'import submitit' 2>/dev/null; then
        if out="$(cd "$WORK" && "$PY" - <<'EOF'
import os, time
import submitit


def rank():
    return os.environ["SLURM_PROCID"]


ex = submitit.AutoExecutor(folder="submitit")
ex.update_parameters(slurm_partition="dev", nodes=2, tasks_per_node=1, timeout_min=5)
job = ex.submit(rank)
assert ex.cluster == "slurm", ex.cluster
results = job.results()
for _ in range(20):  # accounting may lag a moment behind the job's end
    if job.state == "COMPLETED":
        break
    time.sleep(0.5)
print(sorted(results), job.done(), job.state)
assert sorted(results) == ["0", "1"] and job.done() and job.state == "COMPLETED"
EOF
        )"; then pass "submitit: $out"; else fail "submitit: $out"; fi
    fi
else
    echo "(no training run: SMOKE_TRAIN=0 or no $PY)"
fi

# --- down: nothing of the cluster left ---------------------------------------------------------
pids="$(cat "$DEV_CLUSTER_DIR"/pid/*.pid)"
"$CLUSTER" down
alive=""
for pid in $pids; do
    # zombies (Z) do not count: some machines' PID 1 never reaps orphans
    state="$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)" || true
    [[ -n "$state" && "$state" != Z ]] && alive+=" $pid"
done
[[ -z "$alive" ]] && pass "down stopped every daemon" || fail "still running after down:$alive"
[[ ! -e "$DEV_CLUSTER_DIR" ]] && pass "down removed $DEV_CLUSTER_DIR" || fail "$DEV_CLUSTER_DIR still exists"
"$CLUSTER" status >/dev/null && fail "status exits 0 after down" || pass "status exits 1 after down"

echo
if ((failures)); then
    echo "$failures check(s) FAILED"
    exit 1
fi
echo "all dev-cluster checks passed"
