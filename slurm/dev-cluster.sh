#!/usr/bin/env bash
# A real three-node Slurm cluster (with accounting) on ONE machine, for trying multi-node jobs on a
# laptop and for CI. Needs root on Debian/Ubuntu; installs slurm-wlm, munge, slurmdbd and
# mariadb-server with apt when they are missing. No systemd; nothing written to /etc (but see the
# /etc/hosts fallback below).
#
#   slurm/dev-cluster.sh up       start munged, mariadbd, slurmdbd, slurmctld and slurmd n1 + n2 + n3
#   slurm/dev-cluster.sh env      print the export lines:  eval "$(slurm/dev-cluster.sh env)"
#   slurm/dev-cluster.sh status   sinfo, or "down" (exit 1)
#   slurm/dev-cluster.sh down     stop every daemon it started (by pid) and remove the state folder
#
# SLURM=24.11 or SLURM=26.05 (any command): the same cluster on that Slurm, from a Debian root built once
# (slurm/dev-cluster-root.sh); its state folder is DEV_CLUSTER_DIR's default with "-<version>" added, so versions run
# side by side. Without SLURM: this machine's own Slurm (Debian 12's 22.05 here).
#
# Everything (configs, spool, logs, pid files, munge key and socket, mariadb datadir) lives in
# DEV_CLUSTER_DIR (default ${TMPDIR:-/tmp}/slurm-ddp-dev-cluster). Several clusters can run side by
# side with different DEV_CLUSTER_DIRs: each picks its own free ports and its own munge socket.
# Other settings: DEV_CLUSTER_CPUS (CPUs per node, default: this machine's), DEV_CLUSTER_PORT_BASE
# (where the search for free ports starts, default 30817), DEV_CLUSTER_HOSTS=etc-hosts (use the
# /etc/hosts fallback below even where mount namespaces work).
#
# Node names: jobs must resolve n1, n2 and n3 (our trainer uses the first host of the node list as
# MASTER_ADDR). The daemons therefore run in a private mount namespace in which a hosts file from
# the state folder (the machine's /etc/hosts plus "127.0.0.1 n1 n2 n3") is bind-mounted over
# /etc/hosts; every job process, a child of slurmd, inherits that view, while the machine's
# /etc/hosts stays untouched. Where mount namespaces are not allowed (an unprivileged container),
# the script falls back to appending one marked line to /etc/hosts and removes it on `down`.
set -euo pipefail
# Daemons live in sbin, which some shells (sudo, containers) leave out of PATH.
PATH="$PATH:/usr/sbin:/sbin"
# shellcheck source=slurm/dev-cluster-root.sh
source "$(dirname "${BASH_SOURCE[0]}")/dev-cluster-root.sh"
resolve_version

STATE="${DEV_CLUSTER_DIR:-${TMPDIR:-/tmp}/slurm-ddp-dev-cluster${ROOT_SUITE:+-$SLURM_VERSION}}"
CLUSTER=ddpdev                  # ClusterName in slurm.conf and slurmdbd
NODES=(n1 n2 n3)
PORT_BASE="${DEV_CLUSTER_PORT_BASE:-30817}"
MARKER=".slurm-ddp-dev-cluster"  # a folder holding this file is ours to delete
HOSTS_TAG="# slurm-ddp-dev-cluster ${STATE}"

# Paths inside the state folder. Unix socket paths must stay short (108 bytes).
CONF="$STATE/slurm.conf"
GPUS=4  # fake GPUs per node (files named in gres.conf)
DBD_CONF="$STATE/slurmdbd.conf"
PORTS_FILE="$STATE/ports"
HOSTS_FILE="$STATE/hosts"
MUNGE_DIR="$STATE/munge"
MUNGE_SOCK="$MUNGE_DIR/munge.socket"
DB_DIR="$STATE/mariadb"
DB_SOCK="$DB_DIR/mariadb.sock"
LOG_DIR="$STATE/log"
PID_DIR="$STATE/pid"
SPOOL="$STATE/spool"

# The daemons: name of the pid file, and the command name the process must have (checked, so that
# a stale pid file never makes us signal an unrelated process).
DAEMONS=(n1:slurmd n2:slurmd n3:slurmd slurmctld:slurmctld slurmdbd:slurmdbd mariadbd:mariadbd munged:munged ns:sleep)

die() { echo "dev-cluster: $*" >&2; exit 1; }
say() { echo "dev-cluster: $*" >&2; }

usage() {
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------
# pids
# ---------------------------------------------------------------------------------------------

# Prints the pid recorded for daemon NAME if that process is alive (not a zombie) and still runs the expected
# command COMM; fails otherwise (slurm/daemons.py).
live_pid() { "${SUPERVISOR[@]}" pid "$PID_DIR/$1.pid" --comm "$2"; }

# Sends TERM to PIDS, waits up to 8 s for them to exit, then sends KILL.
stop_pids() {
    (($# > 0)) || return 0
    "${SUPERVISOR[@]}" stop --grace 8 --name dev-cluster "$@" || true
}

# Waits up to SECS seconds for COMMAND to succeed; on timeout says what it waited for, shows the
# command's last output, and fails.
wait_for() {
    local secs="$1" what="$2" out
    shift 2
    local deadline=$((SECONDS + secs))
    until out="$("$@" 2>&1)"; do
        if ((SECONDS >= deadline)); then
            say "timed out after ${secs} s waiting for $what; the last try ($*) said:"
            tail -n 5 <<<"$out" >&2
            return 1
        fi
        sleep 0.1
    done
}

# ---------------------------------------------------------------------------------------------
# ports: the trainer derives MASTER_PORT from the job id in 15000-29999, and Linux hands out
# ephemeral ports from 32768, so search 30817..32767 for ports no TCP socket uses.
# ---------------------------------------------------------------------------------------------

port_used() {
    local hex
    hex="$(printf '%04X' "$1")"
    # column 2 is local_address as ADDR:PORT in hex; any state (listening or connected) counts
    awk -v p=":$hex" 'NR > 1 && substr($2, length($2) - 4) == p { found = 1 } END { exit !found }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

pick_ports() {  # prints N free ports
    local n="$1" port="$PORT_BASE" got=0
    while ((got < n)); do
        ((port < 32768)) || die "no $n free TCP ports between $PORT_BASE and 32767"
        if ! port_used "$port"; then echo "$port"; got=$((got + 1)); fi
        port=$((port + 1))
    done
}

# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------

install_missing() {
    local bin missing=()
    for bin in munged mungekey slurmctld slurmd slurmdbd sbatch sacct sacctmgr mariadbd \
        mariadb mariadb-admin mariadb-install-db; do
        command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) && return 0
    say "missing ${missing[*]}; installing slurm-wlm munge slurmdbd mariadb-server"
    local pkgs=(slurm-wlm munge slurmdbd mariadb-server)
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be stale or absent (fresh container): update only when needed.
    local log="$LOG_DIR/apt.log"
    apt-get install -y -q "${pkgs[@]}" >"$log" 2>&1 ||
        { apt-get update -q >>"$log" 2>&1 && apt-get install -y -q "${pkgs[@]}" >>"$log" 2>&1; } ||
        { tail -20 "$log" >&2; die "apt-get install failed (log: $log)"; }
}

# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

# Slurm 25.11 and later let a job ask for an expedited requeue (sbatch --requeue=expedite): eligible at once, first
# in the queue. The cluster allows it where its slurmctld offers it (asked of the binary's own version).
expedited_requeue() {
    local version
    version="$(${ROOT:+chroot "$ROOT"} slurmctld -V | grep -oE '[0-9]+\.[0-9]+' | head -n 1)"
    if [[ -n "$version" ]] && printf '25.11\n%s\n' "$version" | sort -V -C; then
        echo "SlurmctldParameters=enable_expedited_requeue"
    fi
}

write_configs() {
    local ctld_port="$1" dbd_port="$2" db_port="$3" n1_port="$4" n2_port="$5" n3_port="$6" db_pass="$7"
    local cpus mem
    # Each node advertises the whole machine (SlurmdParameters=config_overrides makes slurmd
    # trust these numbers); at least 2 CPUs so 2 tasks per node can be tried anywhere.
    cpus="${DEV_CLUSTER_CPUS:-$(nproc)}"
    ((cpus >= 2)) || cpus=2
    mem="$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)"
    # Seconds since 2026-01-01: ids grow across restarts and stay below MaxJobId (67 million), for 4 months before they
    # wrap; each cluster counts in a range of its own (DEV_CLUSTER_ID 0-4, by default one per Slurm version), so
    # clusters side by side never share a job id, and with it a run folder runs/<job id>.
    local slot="${DEV_CLUSTER_ID:-}"
    [[ -n "$slot" ]] || case "$SLURM_VERSION" in 24.11) slot=1 ;; 26.05) slot=2 ;; *) slot=0 ;; esac
    [[ "$slot" =~ ^[0-4]$ ]] || die "DEV_CLUSTER_ID must be 0, 1, 2, 3 or 4, got '$slot'"
    # slot * 3000 on top: every node of every dev cluster is this machine, and a job's MASTER_PORT is derived from its id
    # modulo 15000 (trainer/core/env.py); 12 million apart alone (a multiple of 15000), every slot would give jobs
    # started together the same port. Now any two slots are at least 3000 jobs apart in port space.
    local first_job_id=$(( ($(date +%s) - 1767225600) % 12000000 + 1000 + slot * 12000000 + slot * 3000 ))

    cat >"$CONF" <<EOF
# Generated by slurm/dev-cluster.sh: a 3-node cluster on one machine. Removed by "down".
ClusterName=$CLUSTER
# "localhost" is accepted as the controller's name on any machine; clients reach it on 127.0.0.1.
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
# Root runs everything: no slurm user needs to exist, and jobs may run as any user.
SlurmUser=root
SlurmdUser=root
# Our own munge daemon; cred_expire=10: a requeued job waits for its credential to expire before
# it may start again (default 120 s).
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
CredType=cred/munge

StateSaveLocation=$SPOOL/slurmctld
SlurmctldPidFile=$PID_DIR/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
# Several slurmd on one machine (Debian builds multiple-slurmd support): %n is the node name.
SlurmdSpoolDir=$SPOOL/%n
SlurmdPidFile=$PID_DIR/%n.pid
SlurmdLogFile=$LOG_DIR/%n.log
# The nodes share one box, so slurmd must not compare what it finds with the node definitions.
SlurmdParameters=config_overrides
PlugStackConfig=$STATE/plugstack.conf
MailProg=/bin/true

# No cgroups in containers/sandboxes: track processes by parent pid. Tasks are bound to CPUs only when a job asks
# (--cpu-bind): the three nodes share this machine's CPUs, so binding by default would stack them on the first cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=None
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A requeued job may start again once its BeginTime (requeue + cred_expire) has passed, but only
# a scheduling pass starts it: every 2 s instead of every 30 s (backfill) / 60 s (main loop).
SchedulerParameters=bf_interval=2,sched_interval=2
$(expedited_requeue)
# "scontrol requeue" and sbatch --requeue work; nodes come back by themselves after a restart.
JobRequeue=1
# Job ids keep growing across restarts of this cluster (its state is wiped on down): a reused id would
# find the previous job's run folder (runs/<job id>) and submitit result files and mistake them for its own.
FirstJobId=$first_job_id
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmdTimeout=60

# Accounting through our slurmdbd (submitit's job.state and sacct need it). The "password" of the
# slurmdbd connection is the munge socket to use, since ours is not the default one.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$dbd_port
AccountingStoragePass=$MUNGE_SOCK

# Four GPUs per node that are files (gres.conf): Slurm allocates, binds and exports them (CUDA_VISIBLE_DEVICES,
# SLURM_STEP_GPUS, SLURM_JOB_GPUS) as at a site, so placement is tested against what Slurm really gives a task.
GresTypes=gpu
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n1_port CPUs=$cpus RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n2_port CPUs=$cpus RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN
NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$n3_port CPUs=$cpus RealMemory=$mem Gres=gpu:$GPUS State=UNKNOWN
PartitionName=dev Nodes=n1,n2,n3 Default=YES MaxTime=INFINITE State=UP
EOF
    : >"$STATE/plugstack.conf"  # keeps the machine's /etc/slurm/plugstack.conf out of our jobs
    if pyxis; then  # built for this machine's Slurm (containers/pyxis.sh): srun --container-image
        echo "required $PYXIS_DIR/lib/spank_pyxis.so runtime_path=$STATE/pyxis" >"$STATE/plugstack.conf"
    fi
    # No NVML here: the devices are listed, not detected, and each slurmd reads the line of its own node name. Slurm
    # wants character devices ("not a valid character or block device" for files) and takes the index from the
    # name; nothing opens them (no device cgroup: no task/cgroup), so they carry the NVIDIA driver's numbers.
    mkdir -p "$STATE/dev"
    for ((i = 0; i < GPUS; i++)); do [[ -c "$STATE/dev/nvidia$i" ]] || mknod "$STATE/dev/nvidia$i" c 195 "$i"; done
    printf 'AutoDetect=off\nNodeName=n[1-3] Name=gpu File=%s/dev/nvidia[0-%d]\n' "$STATE" $((GPUS - 1)) >"$STATE/gres.conf"

    # slurmdbd reads slurmdbd.conf from the folder of $SLURM_CONF; it refuses a readable one.
    (
        umask 077
        cat >"$DBD_CONF" <<EOF
# Generated by slurm/dev-cluster.sh.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$PID_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=slurm_acct_db
EOF
    )

    # The hosts file bind-mounted over /etc/hosts inside the daemons' namespace.
    { grep -v -F "$HOSTS_TAG" /etc/hosts || true; echo "127.0.0.1 ${NODES[*]}"; } >"$HOSTS_FILE"
}

# ---------------------------------------------------------------------------------------------
# the mount namespace the daemons (and so every job) run in
# ---------------------------------------------------------------------------------------------

IN_NS=()  # command prefix that runs a program inside the namespace (empty in /etc/hosts mode)

# Runs a program of the cluster's Slurm, munge or MariaDB: inside the root for another version, else here.
run() { "${IN_NS[@]}" "$@"; }

# In a later invocation (status, down): join the root's namespace of a cluster that runs from a root.
join_root() {
    local pid
    if [[ -n "$ROOT_SUITE" ]] && pid="$(live_pid ns sleep)"; then
        IN_NS=(nsenter --target "$pid" --mount --root -- /usr/bin/env -C "$STATE")
    fi
}

start_namespace() {
    if [[ -n "$ROOT_SUITE" ]]; then
        start_root_namespace
        return
    fi
    if [[ "${DEV_CLUSTER_HOSTS:-namespace}" == namespace ]] &&
        unshare --mount --propagation private true 2>/dev/null; then
        # A "sleep infinity" holds the namespace open; daemons join it with nsenter.
        # shellcheck disable=SC2016  # $1, $2, $$ belong to the inner shell
        setsid -f unshare --mount --propagation private -- bash -c \
            'mount --bind "$1" /etc/hosts && echo $$ >"$2" && exec sleep infinity' \
            ns "$HOSTS_FILE" "$PID_DIR/ns.pid" </dev/null >>"$LOG_DIR/ns.log" 2>&1
        wait_for 5 "the mount namespace" live_pid ns sleep || die "could not create a mount namespace (see $LOG_DIR/ns.log)"
        local pid ns
        pid="$(live_pid ns sleep)"
        # The namespace's inode number identifies it. Never record our own namespace: `down`
        # stops every process left in the recorded one.
        ns="$(stat -L -c %i "/proc/$pid/ns/mnt")"
        [[ "$ns" != "$(stat -L -c %i /proc/self/ns/mnt)" ]] || die "unshare did not create a new mount namespace"
        echo "$ns" >"$STATE/mntns"
        IN_NS=(nsenter --target "$pid" --mount --)
        echo namespace >"$STATE/hosts_mode"
    else
        # Fallback: make n1/n2/n3 resolvable machine-wide with one marked line.
        say "no private mount namespace (unavailable, or DEV_CLUSTER_HOSTS is set);" \
            "adding '127.0.0.1 ${NODES[*]}' to /etc/hosts until \"$0 down\""
        # Rewrite in place (not sed -i): /etc/hosts is often a bind mount in containers.
        local lines
        lines="$(grep -v -F "$HOSTS_TAG" /etc/hosts || true)"
        printf '%s\n%s\n' "$lines" "127.0.0.1 ${NODES[*]} $HOSTS_TAG" >/etc/hosts
        echo etc-hosts >"$STATE/hosts_mode"
    fi
}

# Starts a program detached from this shell (setsid -f: it outlives us, its output goes to LOG,
# and it does not hold our stdout open, so `x=$(dev-cluster.sh up)` returns).
spawn() {
    local log="$1"
    shift
    setsid -f "${IN_NS[@]}" "$@" </dev/null >>"$log" 2>&1
}

# ---------------------------------------------------------------------------------------------
# daemons
# ---------------------------------------------------------------------------------------------

start_munge() {
    run mungekey --create --keyfile="$MUNGE_DIR/munge.key" >/dev/null
    chmod 600 "$MUNGE_DIR/munge.key"
    spawn "$LOG_DIR/munged.out" munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCK" \
        --pid-file="$PID_DIR/munged.pid" --log-file="$LOG_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed"
    # shellcheck disable=SC2016  # $1 belongs to the inner shell
    wait_for 10 munged run bash -c 'munge -S "$1" -n | unmunge -S "$1"' _ "$MUNGE_SOCK" || return 1
}

start_mariadb() {
    local port="$1" pass="$2"
    # Small InnoDB files: initialising the datadir takes 0.7 s instead of 4 s. slurmdbd logs
    # "Database settings not recommended values: innodb_buffer_pool_size" for this; harmless here.
    # The lock wait timeout is the one slurmdbd asks for.
    local innodb=(--innodb-buffer-pool-size=32M --innodb-log-file-size=8M
        --innodb-data-file-path=ibdata1:4M:autoextend --innodb-lock-wait-timeout=900)
    # No TLS on this loopback-only server: MariaDB 11 turns it on by default, and Slurm 24.11's slurmdbd then fails
    # its first query ("Number of columns in result set exceeds..."); without it, it connects in plain text.
    # --no-defaults everywhere: the machine's /etc/mysql config (socket, datadir) is not ours.
    run mariadb-install-db --no-defaults --datadir="$DB_DIR/data" --user=root \
        --auth-root-authentication-method=normal --skip-test-db "${innodb[@]}" \
        >"$LOG_DIR/mariadb-install.log" 2>&1 || { tail -20 "$LOG_DIR/mariadb-install.log" >&2; return 1; }
    spawn "$LOG_DIR/mariadbd.out" mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" \
        --socket="$DB_SOCK" --pid-file="$PID_DIR/mariadbd.pid" --log-error="$LOG_DIR/mariadbd.log" \
        --port="$port" --bind-address=127.0.0.1 --skip-name-resolve --skip-ssl "${innodb[@]}"
    wait_for 30 mariadbd run mariadb-admin --no-defaults --skip-ssl --socket="$DB_SOCK" -u root ping || return 1
    # slurmdbd connects over TCP to 127.0.0.1 (it has no socket-path setting).
    run mariadb --no-defaults --skip-ssl --socket="$DB_SOCK" -u root -e "
        CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    spawn "$LOG_DIR/slurmdbd.out" slurmdbd
    # No "sacctmgr add cluster": slurmctld registers the cluster itself when it first connects.
    wait_for 30 slurmdbd run sacctmgr -n list cluster || return 1
}

# Pyxis and enroot, where containers/pyxis.sh built them: for this machine's Slurm only (a SPANK plugin is built
# against one version's headers), so not in the clusters of another version's root.
PYXIS_DIR="$(realpath -m -- "${PYXIS_DIR:-${TMPDIR:-/tmp}/slurm-ddp-pyxis}")"
pyxis() { [[ -z "${ROOT_SUITE:-}" && -f "$PYXIS_DIR/lib/spank_pyxis.so" && -x "$PYXIS_DIR/bin/enroot" ]]; }

# The folder of node $1's `enroot`: pyxis runs enroot from the PATH (the one variable it keeps of slurmstepd's), and
# the three nodes share one machine, so each node's enroot keeps its containers in folders of its own.
enroot_of() {
    local dir="$STATE/enroot/$1"
    mkdir -p "$dir/bin" "$STATE/enroot/cache" "$STATE/enroot/tmp"
    printf '#!/bin/sh\nexport ENROOT_DATA_PATH=%q ENROOT_RUNTIME_PATH=%q ENROOT_CACHE_PATH=%q ENROOT_TEMP_PATH=%q\nexec %q "$@"\n' \
        "$dir/data" "$dir/run" "$STATE/enroot/cache" "$STATE/enroot/tmp" "$PYXIS_DIR/bin/enroot" >"$dir/bin/enroot"
    chmod 755 "$dir/bin/enroot"
    echo "$dir/bin"
}

start_slurmctld() {
    # -i: ignore state files from an older cluster in this folder (there are none after "down").
    spawn "$LOG_DIR/slurmctld.out" slurmctld -f "$CONF" -i
    wait_for 20 slurmctld run bash -c 'scontrol ping | grep -q UP' || return 1
}

start_slurmd() {
    local node
    for node in "${NODES[@]}"; do
        mkdir -p "$SPOOL/$node"
        if pyxis; then
            spawn "$LOG_DIR/$node.out" env PATH="$(enroot_of "$node"):$PYXIS_DIR/bin:$PATH" slurmd -f "$CONF" -N "$node"
        else
            spawn "$LOG_DIR/$node.out" slurmd -f "$CONF" -N "$node"
        fi
    done
    wait_for 30 "nodes ${NODES[*]} to be idle" nodes_idle || return 1
}

nodes_idle() {
    local states
    states="$(run sinfo -h -N -o '%N %T' | sort -u)"
    [[ "$states" == "$(printf '%s idle\n' "${NODES[@]}")" ]]
}

# slurmctld has registered the cluster with slurmdbd, and sacct answers without complaint (it
# only warns when slurmdbd is unreachable).
accounting_ok() {
    local err
    run sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" &&
        err="$(run sacct -n -X -o JobID 2>&1 >/dev/null)" && [[ -z "$err" ]]
}

# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------

# 0: every daemon alive; 1: none (or no cluster); 2: some.
cluster_state() {
    local d want=0 alive=0
    [[ -f "$STATE/$MARKER" ]] || return 1
    for d in "${DAEMONS[@]}"; do
        # no namespace holder in /etc/hosts mode
        [[ "$d" == ns:sleep && "$(cat "$STATE/hosts_mode" 2>/dev/null)" == etc-hosts ]] && continue
        want=$((want + 1))
        live_pid "${d%%:*}" "${d#*:}" >/dev/null && alive=$((alive + 1))
    done
    ((alive == want)) && return 0
    ((alive == 0)) && return 1
    return 2
}

print_env() {
    printf 'export SLURM_CONF=%q\n' "$CONF"
    if [[ -n "$ROOT_SUITE" ]]; then  # this version's commands, from its root
        # shellcheck disable=SC2016  # $PATH expands where the line is evaluated
        printf 'export PATH=%q:"$PATH"\n' "$STATE/bin"
    fi
}

cmd_env() {
    [[ -f "$STATE/$MARKER" && -f "$CONF" ]] || die "no dev cluster in $STATE (run: $0 up)"
    print_env
}

cmd_status() {
    local rc=0
    cluster_state || rc=$?
    case "$rc" in
        0) join_root; SLURM_CONF="$CONF" run sinfo -N -l && return 0 ;;
        1) echo "dev cluster is down ($STATE)"; return 1 ;;
        *)
            echo "dev cluster is partly down ($STATE); dead:"
            local d
            for d in "${DAEMONS[@]}"; do
                live_pid "${d%%:*}" "${d#*:}" >/dev/null || echo "  ${d%%:*}"
            done
            echo "run: $0 down && $0 up"
            return 1
            ;;
    esac
}

cmd_up() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (it starts slurmd, munged and mariadbd as root)"
    # Slurm config values and AuthInfo lists cannot hold these characters.
    [[ "$STATE" == /* && "$STATE" != *[[:space:],=\#]* ]] ||
        die "DEV_CLUSTER_DIR must be an absolute path without spaces, ',', '=' or '#': '$STATE'"
    ((${#STATE} <= 80)) || die "DEV_CLUSTER_DIR is too long for unix socket paths (max 80 characters)"

    local rc=0
    cluster_state || rc=$?
    if ((rc == 0)); then
        say "already up ($STATE)"
        print_up
        return 0
    fi
    # (An empty folder, e.g. from mktemp -d, is simply used.)
    if [[ -e "$STATE" && ! (-d "$STATE" && -z "$(ls -A "$STATE")") ]]; then
        [[ -f "$STATE/$MARKER" ]] || die "$STATE exists and was not made by this script; set DEV_CLUSTER_DIR"
        say "cleaning up a stopped or half-started cluster in $STATE"
        cmd_down >/dev/null
    fi

    local t0=$SECONDS
    mkdir -p "$STATE" "$MUNGE_DIR" "$DB_DIR" "$LOG_DIR" "$PID_DIR" "$SPOOL/slurmctld"
    touch "$STATE/$MARKER"
    if [[ -n "$ROOT_SUITE" ]]; then
        # shellcheck disable=SC2046  # one package per word
        ROOT="$(bash "$HERE/debian-root.sh" "$ROOT_SUITE" $(root_packages "$ROOT_SUITE"))" ||
            die "the Debian $ROOT_SUITE root for Slurm $SLURM_VERSION could not be built (above: which step, and how to retry)"
        echo "$ROOT" >"$STATE/root"
    else
        install_missing
    fi
    echo "$SLURM_VERSION" >"$STATE/version"
    # munged wants its socket folder searchable by all (any user's sbatch talks to it) and
    # writable by no one else; the key itself is mode 600.
    chmod 755 "$STATE" "$MUNGE_DIR"

    local ports db_pass
    mapfile -t ports < <(pick_ports 6)
    printf 'slurmctld=%s\nslurmdbd=%s\nmariadb=%s\nn1=%s\nn2=%s\nn3=%s\n' "${ports[@]}" >"$PORTS_FILE"
    # mysql's password: no '#' (slurmdbd.conf), nothing that needs SQL quoting
    db_pass="$(tr -dc 'a-zA-Z0-9' </dev/urandom | head -c 24)" || true
    write_configs "${ports[@]}" "$db_pass"
    export SLURM_CONF="$CONF"

    start_namespace
    [[ -z "$ROOT_SUITE" ]] || check_job_python
    if ! { start_munge && start_mariadb "${ports[2]}" "$db_pass" && start_slurmdbd &&
        start_slurmctld && start_slurmd && wait_for 20 "accounting" accounting_ok; }; then
        local f
        for f in "$LOG_DIR"/*; do
            [[ -s "$f" ]] && { echo "==> $f <==" >&2; tail -n 15 "$f" >&2; }
        done
        stop_all
        die "up failed; the daemons were stopped, logs kept in $LOG_DIR (\"$0 down\" removes them)"
    fi
    say "up in $((SECONDS - t0)) s"
    print_up
}

print_up() {
    local ports
    ports="$(tr '\n' ' ' <"$PORTS_FILE")"
    cat <<EOF
dev cluster '$CLUSTER' is up: Slurm $SLURM_VERSION${ROOT_SUITE:+ (Debian $ROOT_SUITE root)}, nodes ${NODES[*]}, partition dev (default), accounting on
state folder: $STATE   (ports: ${ports% })
use it from a shell with:
$(print_env | sed 's/^/  /')
or: eval "\$(${ROOT_SUITE:+SLURM=$SLURM_VERSION }$0 env)"       stop it with: ${ROOT_SUITE:+SLURM=$SLURM_VERSION }$0 down
EOF
}

# Stops every process of the cluster; keeps the state folder.
stop_all() {
    local d pid pids=() left=()
    # Cancel jobs first so slurmstepd and job processes end cleanly (and in /etc/hosts mode,
    # where there is no namespace to sweep, at all).
    join_root
    if live_pid slurmctld slurmctld >/dev/null; then
        local jobs
        jobs="$(SLURM_CONF="$CONF" timeout 5 "${IN_NS[@]}" squeue -h -o %A 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086  # one job id per word
            SLURM_CONF="$CONF" timeout 5 "${IN_NS[@]}" scancel $jobs 2>/dev/null || true
            local deadline=$((SECONDS + 5))
            while ((SECONDS < deadline)) &&
                [[ -n "$(SLURM_CONF="$CONF" timeout 5 "${IN_NS[@]}" squeue -h -o %A 2>/dev/null || true)" ]]; do
                sleep 0.2
            done
        fi
    fi
    # In waves: slurmctld talks to slurmdbd (through munge) while it shuts down; killing all at
    # once makes it wait for a dead slurmdbd.
    local wave
    for wave in "n1 n2 n3 slurmctld" "slurmdbd" "mariadbd munged ns"; do
        pids=()
        for d in "${DAEMONS[@]}"; do
            [[ " $wave " == *" ${d%%:*} "* ]] || continue
            pid="$(live_pid "${d%%:*}" "${d#*:}")" && pids+=("$pid")
        done
        stop_pids "${pids[@]}"
    done

    # Whatever is still in our mount namespace (slurmstepd, job processes) belongs to us.
    local ns
    ns="$(cat "$STATE/mntns" 2>/dev/null || true)"
    if [[ -n "$ns" && "$ns" != "$(stat -L -c %i /proc/self/ns/mnt)" &&
        "$ns" != "$(stat -L -c %i /proc/1/ns/mnt 2>/dev/null)" ]]; then
        mapfile -t left < <("${SUPERVISOR[@]}" left --mntns "$ns")
        ((${#left[@]} == 0)) || { say "stopping ${#left[@]} leftover job process(es)"; stop_pids "${left[@]}"; }
    fi

    if [[ "$(cat "$STATE/hosts_mode" 2>/dev/null)" == etc-hosts ]] && grep -q -F "$HOSTS_TAG" /etc/hosts; then
        local lines
        lines="$(grep -v -F "$HOSTS_TAG" /etc/hosts || true)"
        printf '%s\n' "$lines" >/etc/hosts
    fi
}

cmd_down() {
    if [[ ! -e "$STATE" ]]; then
        echo "dev cluster is not running ($STATE does not exist)"
        return 0
    fi
    [[ -f "$STATE/$MARKER" ]] || die "$STATE was not made by this script; not touching it"
    local t0=$SECONDS
    stop_all
    rm -rf -- "$STATE"
    echo "dev cluster stopped and $STATE removed ($((SECONDS - t0)) s)"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    env) cmd_env ;;
    status) cmd_status ;;
    *) usage ;;
esac
