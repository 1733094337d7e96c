#!/usr/bin/env bash
# Apptainer from Debian sid, on a machine whose own Debian packages none (Debian 12): a root built once with
# debootstrap (slurm/debian-root.sh), a mount namespace pivoted into it (Apptainer refuses a plain chroot), and an
# `apptainer` on PATH that runs the root's from the caller's folder. Jobs on the dev cluster find it on the PATH
# sbatch passes on, so a profile with `container.runtime: apptainer` runs its tasks in a real SIF.
#
#   containers/apptainer.sh up       build the root if needed (cached), start the namespace, write the wrapper
#   containers/apptainer.sh env      print the export line:  eval "$(containers/apptainer.sh env)"
#   containers/apptainer.sh status   exit 0 when apptainer answers
#   containers/apptainer.sh down     stop the namespace and remove the state folder
#
# State: ${APPTAINER_DIR:-${TMPDIR:-/tmp}/slurm-ddp-apptainer}. Run as root, Apptainer is told to use a user
# namespace (APPTAINER_USERNS=1), the unprivileged mode that sites without a setuid starter run. Needs root.
set -euo pipefail

STATE="${APPTAINER_DIR:-${TMPDIR:-/tmp}/slurm-ddp-apptainer}"
STATE="$(realpath -m -- "$STATE")"
MARKER="$STATE/.slurm-ddp-apptainer"
PIDFILE="$STATE/ns.pid"
SUITE=sid
# shellcheck source=slurm/dev-cluster-root.sh
source "$(dirname "${BASH_SOURCE[0]}")/../slurm/dev-cluster-root.sh"

say() { echo "apptainer [$SECONDS s]: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

alive() { "${SUPERVISOR[@]}" pid "$PIDFILE" --comm sleep >/dev/null; }

print_env() {
    # shellcheck disable=SC2016  # $PATH expands where the line is evaluated
    printf 'export PATH=%q:"$PATH"\n' "$STATE/bin"
}

cmd_up() {
    ((EUID == 0)) || die "needs root (debootstrap, namespaces)"
    if alive; then
        say "already up ($STATE)"
        print_env
        return 0
    fi
    [[ ! -e "$STATE" || -f "$MARKER" || -z "$(ls -A "$STATE" 2>/dev/null)" ]] ||
        die "$STATE exists and was not made by this script; set APPTAINER_DIR"
    mkdir -p "$STATE"
    touch "$MARKER"
    local root binds=()
    root="$(bash "$HERE/debian-root.sh" "apptainer=$SUITE" apptainer squashfs-tools squashfuse fuse2fs fuse-overlayfs gocryptfs \
        ca-certificates)" || die "the Debian $SUITE root for Apptainer could not be built (above: which step, and how to retry)"
    mapfile -t binds < <(printf '%s\n' "$PROJECT" /tmp "$HOME" | awk '!seen[$0]++')
    [[ "$STATE" == /tmp/* ]] || binds+=("$STATE")
    enter_root "$root" "" "$PIDFILE" "$STATE/ns.log" "${binds[@]}" >/dev/null ||
        die "could not enter the root $root (see $STATE/ns.log)"
    # Root at the wrapper: a user namespace, as an unprivileged user gets (see the header). Containers see the
    # caller's /etc/hosts (the dev cluster's node names live in its namespace's, not in this root's).
    local prelude
    # shellcheck disable=SC2016  # written into the wrapper as is
    prelude='[[ $(id -u) != 0 ]] || export APPTAINER_USERNS=1
hosts="'"$STATE"'/hosts-$(md5sum </etc/hosts | cut -c1-12)"
[[ -s $hosts ]] || { cp /etc/hosts "$hosts.$$" && mv "$hosts.$$" "$hosts"; }
export APPTAINER_BIND="${APPTAINER_BIND:+$APPTAINER_BIND,}$hosts:/etc/hosts"'
    write_wrappers "$STATE/bin" "$PIDFILE" "Apptainer (Debian $SUITE)" "$prelude" apptainer unsquashfs
    "$STATE/bin/apptainer" --version >&2 || die "apptainer does not answer inside the root (see $STATE/ns.log)"
    say "up: $STATE/bin/apptainer"
    print_env
}

cmd_down() {
    [[ -e "$STATE" ]] || { echo "apptainer is not running ($STATE does not exist)"; return 0; }
    [[ -f "$MARKER" ]] || die "$STATE was not made by this script; not touching it"
    local pid
    if alive; then
        pid="$(cat "$PIDFILE")"
        kill "$pid" 2>/dev/null || true
    fi
    rm -rf -- "$STATE"
    echo "apptainer stopped and $STATE removed"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    env) [[ -f "$MARKER" ]] || die "not up ($STATE; run: $0 up)"; print_env ;;
    status) alive && "$STATE/bin/apptainer" --version >/dev/null 2>&1 ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
