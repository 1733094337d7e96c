# shellcheck shell=bash
# Sourced by slurm/dev-cluster.sh: the same cluster on another Slurm version, from a Debian root.
#
# SLURM=22.05 is Debian 12's (bookworm), 24.11 Debian 13's (trixie), 26.05 Debian sid's. A version this machine's
# apt does not offer runs from a root that slurm/debian-root.sh builds once with debootstrap: the daemons' mount
# namespace pivots into it, with the project folder, /tmp (run folders, this state folder), $HOME and the Python the
# jobs use bound in at the same paths, so a job sees what it would see on this machine. Slurm's commands for that
# version are wrappers in $STATE/bin that run the root's own (`env` puts them first on PATH).

declare -A SUITES=([22.05]=bookworm [24.11]=trixie [26.05]=sid)
ROOT=""  # the Debian root of another Slurm version (cmd_up sets it)
COMMANDS=(sbatch srun salloc squeue sacct sacctmgr scontrol scancel sinfo sstat sprio sreport sshare)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROJECT="$(cd "$HERE/.." && pwd)"
# shellcheck disable=SC2034  # used by the scripts that source this one
SUPERVISOR=(python3 "$HERE/daemons.py")  # which daemons of ours run, stopping them, their leftovers

# This machine's Slurm version (major.minor): the one installed, else the one apt would install. dpkg first: apt-cache
# parses every package list (about a second of CPU), and this runs on every call of the scripts.
host_slurm() {
    local v
    v="$(dpkg-query -W -f='${Status} ${Version}\n' slurm-wlm 2>/dev/null | awk '$3 == "installed" { print $4 }')"
    [[ -n "$v" ]] || v="$(apt-cache show slurm-wlm 2>/dev/null | awk '/^Version:/ { print $2; exit }')"
    grep -oE '^[0-9]+\.[0-9]+' <<<"$v" || true
}

# The version asked for (SLURM, else the one recorded in an existing state folder): sets SLURM_VERSION and
# ROOT_SUITE (empty: this machine's own Slurm). An unknown version is refused with the ones offered (exit 2).
# shellcheck disable=SC2034  # SLURM_VERSION and ROOT_SUITE are dev-cluster.sh's
resolve_version() {
    local asked="${SLURM:-}" offered host
    offered="$(for v in "${!SUITES[@]}"; do echo "$v (Debian ${SUITES[$v]})"; done | sort | paste -sd, - | sed 's/,/, /g')"
    if [[ -n "$asked" && -z "${SUITES[$asked]+x}" ]]; then
        echo "error: SLURM: $asked is not offered; offered: $offered" >&2
        echo "HINT: make dev-cluster SLURM=24.11 (or leave SLURM out for this machine's own Slurm)" >&2
        exit 2
    fi
    host="$(host_slurm)"
    SLURM_VERSION="${asked:-$host}"
    ROOT_SUITE=""  # read by dev-cluster.sh
    if [[ -n "$asked" && "$asked" != "$host" ]]; then
        ROOT_SUITE="${SUITES[$asked]}"
    fi
}

# The root's packages: Slurm with accounting, and the libraries a Python built for this machine loads (pyenv's or
# Debian's CPython: OpenSSL, libffi, sqlite, …; names after Debian's 64-bit time_t transition in trixie and later).
root_packages() {
    local t64=t64
    [[ "$1" == bookworm ]] && t64=""
    echo slurm-wlm slurmdbd munge mariadb-server mariadb-client util-linux procps python3 \
        "libssl3$t64" libffi8 libsqlite3-0 libbz2-1.0 liblzma5 zlib1g "libreadline8$t64" libncursesw6 \
        libstdc++6 libgomp1 libuuid1 "libgdbm6$t64" libexpat1
}

# The Python the jobs use: the project's .venv (what `make` builds), else python3 on PATH.
job_python() {
    if [[ -x "$PROJECT/.venv/bin/python" ]]; then echo "$PROJECT/.venv/bin/python"; else command -v python3; fi
}

# The host paths bound into the root at the same place (one per line).
root_binds() {
    local py prefix real
    printf '%s\n' "$PROJECT" /tmp "$HOME"
    [[ "$STATE" == /tmp/* ]] || echo "$STATE"
    py="$(job_python)" || return 0
    prefix="$("$py" -c 'import sys; print(sys.base_prefix)')"
    real="$(readlink -f "$py")"
    if [[ "$prefix" == /usr ]]; then  # Debian's own CPython: its binary and standard library, not the root's /usr
        echo "$real"
        "$py" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])'
    elif [[ "$prefix" != "$HOME"/* ]]; then
        echo "$prefix"
    fi
}

# enter_root ROOT HOSTS PIDFILE LOG BIND...: a process that holds a private mount namespace pivoted into ROOT, with
# each BIND (a host folder or file) at the same path, the host's /dev, /sys, a /proc, and HOSTS over /etc/hosts (or
# the root's own when HOSTS is empty); prints its pid. Apptainer needs a pivoted root, not a chroot.
enter_root() {
    local root="$1" hosts="$2" pidfile="$3" log="$4" pid i
    shift 4
    rm -f "$pidfile"
    # shellcheck disable=SC2016  # the inner shell's variables
    setsid -f unshare --mount --propagation private -- bash -c '
        set -e
        root=$1 hosts=$2 pidfile=$3
        shift 3
        mount --bind "$root" "$root"   # pivot_root needs a mount point
        for p in "$@"; do
            if [[ -d $p ]]; then mkdir -p "$root$p"; else mkdir -p "$root$(dirname "$p")"; touch "$root$p"; fi
            mount --rbind "$p" "$root$p"
        done
        mount --rbind /dev "$root/dev"
        mount --rbind /sys "$root/sys"
        mount -t proc proc "$root/proc"
        [[ -z $hosts ]] || mount --bind "$hosts" "$root/etc/hosts"
        cd "$root"
        mkdir -p .host
        pivot_root . .host
        umount -l /.host
        echo $$ >"$pidfile"
        exec sleep infinity' holder "$root" "$hosts" "$pidfile" "$@" </dev/null >>"$log" 2>&1
    for ((i = 0; i < 100; i++)); do
        pid="$(cat "$pidfile" 2>/dev/null || true)"
        if [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null)" == sleep ]]; then
            echo "$pid"
            return 0
        fi
        sleep 0.1
    done
    tail -n 5 "$log" >&2
    return 1
}

# write_wrappers BIN PIDFILE LABEL PRELUDE COMMAND...: BIN/<command> runs the root's COMMAND from the caller's
# folder (visible inside at the same path), through the namespace whose holder's pid is in PIDFILE; PRELUDE: shell
# lines run first (may be empty).
write_wrappers() {
    local bin="$1" pidfile="$2" label="$3" prelude="$4" cmd
    shift 4
    mkdir -p "$bin"
    for cmd in "$@"; do
        cat >"$bin/$cmd" <<EOF
#!/bin/bash
# $label's $cmd, run inside its Debian root (slurm/dev-cluster-root.sh).
pid=\$(cat "$pidfile" 2>/dev/null) || { echo "$cmd: $label is not running (no $pidfile)" >&2; exit 1; }
if [[ ! -d /proc/\$pid/root\$PWD ]]; then
    echo "$cmd: \$PWD is not visible inside $label's root; run it from $PROJECT, /tmp or \$HOME" >&2
    exit 2
fi
$prelude
# (env -C: nsenter --wd would enter a folder of this side, outside the root, where getcwd fails)
exec nsenter --target "\$pid" --mount --root -- /usr/bin/env -C "\$PWD" /usr/bin/$cmd "\$@"
EOF
        chmod 755 "$bin/$cmd"
    done
}

# The dev cluster's namespace: the root, this cluster's hosts file, and the Slurm command wrappers.
start_root_namespace() {
    local binds=() pid
    mapfile -t binds < <(root_binds | awk '!seen[$0]++')
    pid="$(enter_root "$ROOT" "$HOSTS_FILE" "$PID_DIR/ns.pid" "$LOG_DIR/ns.log" "${binds[@]}")" ||
        die "could not enter the root $ROOT (see $LOG_DIR/ns.log)"
    stat -L -c %i "/proc/$pid/ns/mnt" >"$STATE/mntns"
    IN_NS=(nsenter --target "$pid" --mount --root -- /usr/bin/env -C "$STATE")
    echo namespace >"$STATE/hosts_mode"
    write_wrappers "$STATE/bin" "$PID_DIR/ns.pid" "the Slurm $SLURM_VERSION dev cluster in $STATE" "" "${COMMANDS[@]}"
}

# Whether the job's Python starts inside the root; if not, which libraries it misses.
check_job_python() {
    local py missing
    py="$(job_python)" || return 0
    if ! "${IN_NS[@]}" "$py" -c 'import ssl, ctypes, sqlite3, bz2, lzma' >/dev/null 2>&1; then
        missing="$("${IN_NS[@]}" ldd "$(readlink -f "$py")" 2>&1 | awk '/not found/ { print $1 }' | paste -sd' ' -)"
        die "the jobs' Python ($py) does not start inside the Slurm $SLURM_VERSION root${missing:+ (missing: $missing)}"
    fi
}
