#!/usr/bin/env bash
# Start/stop a PRIVATE container engine (Debian's docker.io: dockerd 20.10 plus its
# own containerd) for the container tests and for users without a system docker.
# Everything it creates -- images, containers, sockets, pid files, logs -- lives in
# one state folder, so `down` leaves no process, mount or file behind.
#
#   containers/engine.sh up       install docker.io if needed, start, wait until it answers
#   containers/engine.sh down     remove all containers, stop the daemons, unmount, delete the folder
#   containers/engine.sh env      print the export lines:  eval "$(containers/engine.sh env)"
#   containers/engine.sh status   exit 0 if the engine answers, else 1
#
# State folder: ${ENGINE_DIR:-${TMPDIR:-/tmp}/slurm-ddp-engine}. Needs root (dockerd does).
set -euo pipefail

STATE="${ENGINE_DIR:-${TMPDIR:-/tmp}/slurm-ddp-engine}"
# Absolute, because it ends up in a unix:// URL and in other processes' arguments.
STATE="$(realpath -m -- "$STATE")"
SOCK="$STATE/docker.sock"
CTRD_DIR="$STATE/containerd"
CTRD_SOCK="$CTRD_DIR/containerd.sock"
MARKER="$STATE/.slurm-ddp-engine"   # `down` deletes only folders that carry this

# The engine is dockerd 20.10, whose newest API is 1.41. `docker` in PATH may be a
# newer CLI (this machine has docker 28 in /usr/local/bin, ahead of Debian's 20.10
# one in /usr/bin). Docker 28 negotiates down to 1.41 by itself; pinning the
# version keeps clients that do not negotiate (SDKs, older tools) working too.
API_VERSION=1.41

log() { printf 'engine [%2d s]: %s\n' "$SECONDS" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Our own calls use Debian's client (same release as the daemon) when it is there.
DOCKER_BIN=/usr/bin/docker
[[ -x $DOCKER_BIN ]] || DOCKER_BIN=docker
dk() {
  # -H beats DOCKER_HOST/DOCKER_CONTEXT from the caller's environment.
  DOCKER_API_VERSION=$API_VERSION "$DOCKER_BIN" -H "unix://$SOCK" "$@"
}

print_env() {
  # %q: stays eval-safe if the state folder's path has blanks.
  printf 'export DOCKER_HOST=%q\n' "unix://$SOCK"
  echo "export DOCKER_API_VERSION=$API_VERSION"
  # Legacy builder. Docker 23+ CLIs build with BuildKit only through the buildx
  # plugin, which is not installed here: with DOCKER_BUILDKIT=1 they fail, unset
  # they fall back with a deprecation warning. 0 behaves the same on every client.
  echo "export DOCKER_BUILDKIT=0"
}

is_up() { [[ -S $SOCK ]] && dk info >/dev/null 2>&1; }

SUPERVISOR=(python3 "$(dirname "${BASH_SOURCE[0]}")/../slurm/daemons.py")  # our daemons: which run, stopping them
alive() { "${SUPERVISOR[@]}" alive "$1"; }

# pid from FILE if that process is alive and is one of ours (its command line names
# the state folder), so a stale pid file can never make us signal a stranger.
our_pid() { "${SUPERVISOR[@]}" pid "$1" --cmdline-has "$STATE"; }

# TERM, wait up to ~10 s, then KILL.
stop_pid() {
  "${SUPERVISOR[@]}" stop --grace 10 --name "$2" "$1" || log "WARNING: $2 (pid $1) is still there after KILL"
}

# Our containers' ids: the folder names under the data root.
container_ids() {
  local d
  [[ -d $STATE/data/containers ]] || return 0
  for d in "$STATE"/data/containers/*/; do
    if [[ -d $d ]]; then basename "$d"; fi
  done
}

# Processes whose cgroup names one of our containers, or that were started with
# our containerd's address (the shims, which outlive containerd by design).
# Used only when a daemon died without cleaning up.
leftover_pids() {
  local ids
  mapfile -t ids < <(container_ids)
  "${SUPERVISOR[@]}" left --cgroup "${ids[@]}" "--cmdline-has=-address $CTRD_SOCK "
}

# Mount points at or under the state folder, deepest first. /proc/mounts writes
# blanks and backslashes as octal escapes; printf %b undoes that.
our_mounts() {
  local mnt
  while read -r _ mnt _; do
    mnt=$(printf '%b' "$mnt")
    if [[ $mnt == "$STATE" || $mnt == "$STATE"/* ]]; then echo "$mnt"; fi
  done </proc/mounts | sort -r -u
}

# Stop everything of ours but keep the data (images) on disk.
stop_engine() {
  local pid ids mnt left
  if is_up; then
    # Remove every container first: dockerd would stop them on exit, but the
    # containerd shims would survive it, and "down" means nothing left running.
    mapfile -t ids < <(dk ps -aq)
    if ((${#ids[@]})); then
      log "removing ${#ids[@]} container(s)"
      dk rm -f "${ids[@]}" >/dev/null || log "WARNING: docker rm -f failed"
    fi
  fi
  if pid=$(our_pid "$STATE/dockerd.pid"); then
    log "stopping dockerd (pid $pid)"
    stop_pid "$pid" dockerd
  fi
  if pid=$(our_pid "$STATE/containerd.pid"); then
    log "stopping containerd (pid $pid)"
    stop_pid "$pid" containerd
  fi
  # Anything still alive is from a daemon that died without cleaning up.
  mapfile -t left < <(leftover_pids)
  if ((${#left[@]})); then
    log "killing leftover process(es): ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.5
  fi
  while read -r mnt; do
    [[ -n $mnt ]] || continue
    umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null \
      || log "WARNING: cannot unmount $mnt"
  done < <(our_mounts)
  rm -f "$SOCK" "$CTRD_SOCK" "$CTRD_SOCK.ttrpc"
  # The shims' sockets go to /run/containerd/s whatever containerd's state folder
  # is, named sha256(<containerd address>/<namespace>/<id>). A shim removes its
  # own on exit; a killed one does not.
  local id
  while read -r id; do
    [[ -n $id ]] || continue
    rm -f "/run/containerd/s/$(printf '%s' "$CTRD_SOCK/moby/$id" | sha256sum | cut -d' ' -f1)"
  done < <(container_ids)
  # Then drop those folders if that left them empty (rmdir does nothing else).
  rmdir /run/containerd/s /run/containerd 2>/dev/null || true
}

install_docker() {
  command -v dockerd >/dev/null && command -v containerd >/dev/null && return 0
  log "dockerd not found; installing Debian's docker.io"
  # No init system runs here, but if policy-rc.d is missing the package's
  # postinst would start a system dockerd on /var/run/docker.sock: forbid that
  # for the duration of the install.
  local policy=/usr/sbin/policy-rc.d made_policy=
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  local rc=0
  # --no-install-recommends: the recommends (needrestart, apparmor, git ...) are
  # not needed for a test engine.
  local apt=(apt-get install -y -q --no-install-recommends docker.io)
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive "${apt[@]}" >&2; } \
    || rc=$?
  [[ -z $made_policy ]] || rm -f "$policy"
  ((rc == 0)) || die "apt-get install docker.io failed (rc $rc)"
  command -v dockerd >/dev/null || die "docker.io installed but no dockerd in PATH ($PATH)"
}

# Run a daemon detached. setsid -f: a new session and process group, so neither
# the caller's terminal nor a CI timeout that kills the caller's process group
# takes the engine down (`down` does that); -f forks, so it returns at once and
# the daemon's parent is PID 1 (which here reaps only lazily, see alive()).
# The inner sh writes its pid to PIDFILE, then becomes the daemon by exec.
# 9>&-: the daemon must not inherit the lock (see take_lock).
# Sets SPAWNED to the daemon's pid: while it starts, we watch that pid itself
# (our_pid's command-line check is for pid files of unknown age, in `down`).
SPAWNED=
spawn() {
  local pidfile=$1 logfile=$2 i
  shift 2
  rm -f "$pidfile"
  # shellcheck disable=SC2016  # $$ and $1 are for the inner sh, not for us
  setsid -f sh -c 'echo $$ >"$1"; shift; exec "$@"' sh "$pidfile" "$@" \
    </dev/null >"$logfile" 2>&1 9>&-
  for ((i = 0; i < 50; i++)); do
    if [[ -s $pidfile ]] && SPAWNED=$(<"$pidfile") && [[ $SPAWNED =~ ^[0-9]+$ ]]; then return 0; fi
    sleep 0.1
  done
  die "could not start $1"
}

# Failed start: show why, stop whatever did start, keep the folder (logs).
start_failed() {
  local logfile=$1 msg=$2
  if [[ -s $logfile ]]; then
    log "last lines of $logfile:"
    tail -n 20 "$logfile" >&2 || true
  else
    log "$logfile is empty"
  fi
  stop_engine
  die "$msg; log: $logfile"
}

start_engine() {
  local i
  mkdir -p "$CTRD_DIR"

  # Our own containerd instead of letting dockerd pick one: dockerd 20.10 uses the
  # system containerd whenever /run/containerd/containerd.sock exists (its state and
  # the "moby" namespace would then be shared with any system docker), and only
  # otherwise starts a child one. A config file of our own also keeps
  # /etc/containerd/config.toml (e.g. the CRI plugin) out of it.
  cat >"$CTRD_DIR/config.toml" <<EOF
version = 2
root = "$CTRD_DIR/root"
state = "$CTRD_DIR/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$CTRD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
EOF
  spawn "$STATE/containerd.pid" "$STATE/containerd.log" \
    containerd --config "$CTRD_DIR/config.toml"
  for ((i = 0; i < 300; i++)); do
    [[ -S $CTRD_SOCK ]] && break
    alive "$SPAWNED" || start_failed "$STATE/containerd.log" "containerd exited at start"
    sleep 0.1
  done
  [[ -S $CTRD_SOCK ]] \
    || start_failed "$STATE/containerd.log" "containerd did not open $CTRD_SOCK in 30 s"

  # A daemon.json of our own so /etc/docker/daemon.json (hosts, bridges of a
  # system docker) cannot change or break this engine. deprecated-key-path
  # (config-file only in 20.10): else dockerd writes /etc/docker/key.json.
  printf '{"deprecated-key-path": "%s"}\n' "$STATE/key.json" >"$STATE/daemon.json"
  local args=(
    --config-file "$STATE/daemon.json"
    --containerd "$CTRD_SOCK"
    --data-root "$STATE/data"
    --exec-root "$STATE/exec"
    # dockerd's own pid file, else it writes /var/run/docker.pid. It cannot be
    # the one spawn writes: dockerd refuses to start if its file names a live pid.
    --pidfile "$STATE/exec/dockerd.pid"
    -H "unix://$SOCK"
    # No docker0 bridge, no NAT and no iptables rules: nothing on the host's
    # network is changed; containers use --network host (builds too).
    --bridge=none --iptables=false --ip-masq=false
    # Fixed limits for containers instead of dockerd's own, inherited from
    # whoever ran `up` (CI, a Slurm job, a login shell), so containers behave
    # the same either way; a huge nofile also makes fd-closing loops crawl.
    --default-ulimit nofile=1024:1024 --default-ulimit nproc=1024:1024
  )
  spawn "$STATE/dockerd.pid" "$STATE/dockerd.log" dockerd "${args[@]}"
  for ((i = 0; i < 600; i++)); do
    is_up && return 0
    alive "$SPAWNED" || start_failed "$STATE/dockerd.log" "dockerd exited before answering"
    sleep 0.1
  done
  start_failed "$STATE/dockerd.log" "dockerd did not answer on $SOCK within 60 s"
}

# Create the state folder with its marker in one step (a rename), so a racing
# `up` never sees it without one; refuse a folder that is not ours, since
# `down` deletes all of it.
claim_state() {
  local tmp
  # (An existing empty folder is fine: the rename replaces it.)
  if [[ ! -e $STATE ]] || [[ -d $STATE && -z $(ls -A "$STATE") ]]; then
    mkdir -p "$(dirname "$STATE")"
    tmp=$(mktemp -d "$STATE.XXXXXX")
    touch "$tmp/${MARKER##*/}"
    mv -T "$tmp" "$STATE" 2>/dev/null || rm -rf "$tmp"
  fi
  [[ -e $MARKER ]] \
    || die "$STATE exists but is not an engine folder (no ${MARKER##*/}); set ENGINE_DIR elsewhere"
}

# One up/down at a time (CI may race two). The lock file lives in the folder
# so `down` leaves nothing; deleting it while we hold it is fine. The daemons
# are started with 9>&- so that they do not inherit the lock and hold it forever.
take_lock() {
  exec 9>"$STATE/engine.lock"
  flock -w 120 9 || die "another engine.sh up/down holds $STATE/engine.lock"
}

cmd_up() {
  ((EUID == 0)) || die "needs root (dockerd does)"
  # unix socket paths are limited to 107 bytes; the longest one we create:
  ((${#CTRD_SOCK} + 6 < 108)) || die "state folder path too long for unix sockets: $STATE"
  if is_up; then
    log "already up ($SOCK)"
    print_env
    return 0
  fi
  claim_state
  take_lock
  if ! is_up; then
    install_docker
    # Whatever a crash or a killed daemon left (processes, mounts); keeps images.
    stop_engine
    start_engine
  fi
  log "up: $SOCK (data in $STATE)"
  print_env
}

cmd_down() {
  if [[ ! -d $STATE ]]; then
    log "already down (no $STATE)"
    return 0
  fi
  [[ -e $MARKER ]] || die "$STATE has no ${MARKER##*/} marker; not touching it"
  ((EUID == 0)) || die "needs root (the daemons and mounts are root's)"
  take_lock
  stop_engine
  local left
  left=$(our_mounts)
  [[ -z $left ]] || die "still mounted under $STATE: $left"
  log "deleting $STATE"
  # --one-file-system: never delete through a mount we failed to remove.
  rm -rf --one-file-system -- "$STATE"
  log "down: removed $STATE"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  env) print_env ;;
  status) is_up ;;
  *)
    echo "usage: $0 up|down|env|status" >&2
    exit 2
    ;;
esac
