#!/usr/bin/env bash
# shellcheck disable=SC2016  # single-quoted job scripts expand inside the job, as intended
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
check() {  # check DESCRIPTION COMMAND...: PASS when COMMAND succeeds
    local what="$1"
    shift
    if "$@"; then pass "$what"; else fail "$what"; fi
}

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
    local state="" deadline=$((SECONDS + 10))
    while ((SECONDS < deadline)); do
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

out="$("$CLUSTER" up 2>&1)"
check "a second up says 'already up'" grep -q "already up" <<<"$out"
check "status exits 0" "$CLUSTER" status

states="$(sinfo -h -N -o '%N %T' | sort -u | tr '\n' ' ')"
check "sinfo: '$states'" test "$states" == "n1 idle n2 idle "

# --- steps: ranks, node names resolvable inside the job ---------------------------------------
out="$(srun -N2 -n2 bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME $(getent hosts n1 | cut -d" " -f1)"' | sort)"
check "srun -N2: ranks 0, 1 on n1, n2; n1 resolves in the job (got: ${out//$'\n'/; })" \
    test "$out" == $'0 n1 127.0.0.1\n1 n2 127.0.0.1'

# --- sbatch + accounting; SLURM_STEP_ID in the batch shell and in a step ----------------------
id="$(sbatch --parsable -N2 --ntasks-per-node=1 -o "$WORK/env-%j.out" --wrap \
    'echo "batch STEP_ID=${SLURM_STEP_ID-unset}"; srun bash -c "echo step STEP_ID=\${SLURM_STEP_ID-unset}"')"
wait_job 60 "$id" || fail "job $id did not finish"
state="$(acct_state "$id")"
check "sacct: job $id is '$state'" test "$state" == COMPLETED
check "batch shell has no SLURM_STEP_ID ($(grep batch "$WORK/env-$id.out"))" \
    grep -qx 'batch STEP_ID=unset' "$WORK/env-$id.out"
check "srun step: SLURM_STEP_ID=0 on both ranks ($(grep step "$WORK/env-$id.out" | tr '\n' ' '))" \
    test "$(grep -c -x 'step STEP_ID=0' "$WORK/env-$id.out")" == 2

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
check "down stopped every daemon (still running:${alive:- none})" test -z "$alive"
check "down removed $DEV_CLUSTER_DIR" test ! -e "$DEV_CLUSTER_DIR"
check "status exits 1 after down" test "$("$CLUSTER" status >/dev/null; echo $?)" == 1

echo
if ((failures)); then
    echo "$failures check(s) FAILED"
    exit 1
fi
echo "all dev-cluster checks passed"
