#!/usr/bin/env bash
# A Debian root made with debootstrap, holding the packages given, built once and kept in a cache folder. The dev
# cluster runs another Slurm version's daemons and commands inside one (slurm/dev-cluster.sh, SLURM=24.11|26.05),
# and Apptainer runs from one (containers/apptainer.sh): no image registry is needed, only Debian's archive.
#
#   slurm/debian-root.sh [NAME=]SUITE PACKAGE...    prints the root's path; builds it first when it is missing
#
# NAME (default: the suite) names the root in the cache, so roots of one suite with other packages live apart.
# Settings (environment): DEV_CLUSTER_ROOTS, the cache folder (default /var/cache/slurm-ddp-roots); DEBIAN_MIRROR
# (default http://deb.debian.org/debian). A root counts once complete: its .complete file lists its packages, and
# one with other packages is built again. Builds of one suite take turns (flock). Needs root (debootstrap, chroot).
set -euo pipefail

suite="${1:?usage: $0 [NAME=]SUITE PACKAGE...}"
name="${suite%%=*}"
suite="${suite#*=}"
shift
packages=("$@")
CACHE="${DEV_CLUSTER_ROOTS:-/var/cache/slurm-ddp-roots}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
root="$CACHE/$name"
want="$(printf '%s\n' "$@" | sort -u | tr '\n' ' ')"

say() { echo "debian-root [$name, $SECONDS s]: $*" >&2; }
complete() { [[ -f "$root/.complete" && "$(cat "$root/.complete")" == "$want" ]]; }

if complete; then
    echo "$root"
    exit 0
fi
((EUID == 0)) || { say "needs root (debootstrap, chroot)"; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/$name.lock"
flock 9
if complete; then  # another build finished while this one waited
    echo "$root"
    exit 0
fi

work="$root.tmp"
log="$CACHE/$name.log"
: >"$log"
unmount_all() {  # what a failed step left mounted in the work folder, deepest first
    local mnt
    while read -r mnt; do
        umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
    done < <(awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r)
}
trap unmount_all EXIT
step() {  # step NAME COMMAND...: run it, its output in the log; on failure say which step and how to retry
    local step_name="$1"
    shift
    say "$step_name"
    if ! "$@" >>"$log" 2>&1; then
        tail -n 20 "$log" >&2
        say "the step '$step_name' failed (its output: $log); retry: rm -rf '$work' && $0 $name=$suite ${packages[*]}"
        exit 1
    fi
}
in_root() { chroot "$work" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root DEBIAN_FRONTEND=noninteractive "$@"; }

if ! command -v debootstrap >/dev/null; then
    step "installing debootstrap" bash -c 'apt-get install -y -q debootstrap || { apt-get update -q && apt-get install -y -q debootstrap; }'
fi
unmount_all
rm -rf --one-file-system "$work"
step "debootstrap $suite (minbase) from $MIRROR" debootstrap --variant=minbase "$suite" "$work" "$MIRROR"
# Daemons are never started by package scripts (dev-cluster.sh starts its own); an archive past its Release
# file's validity date (sid's, at times) is still used.
printf '#!/bin/sh\nexit 101\n' >"$work/usr/sbin/policy-rc.d"
[[ -s "$work/etc/hosts" ]] || printf '127.0.0.1 localhost\n::1 localhost ip6-localhost\n' >"$work/etc/hosts"
chmod 755 "$work/usr/sbin/policy-rc.d"
echo 'Acquire::Check-Valid-Until "false";' >"$work/etc/apt/apt.conf.d/99-valid-until"
mount -t proc proc "$work/proc"
step "apt-get update" in_root apt-get update -q
step "apt-get install $want" in_root apt-get install -y -q --no-install-recommends "$@"
in_root apt-get clean >>"$log" 2>&1 || true
umount "$work/proc"
rm -rf --one-file-system "$root"
mv "$work" "$root"
echo "$want" >"$root/.complete"
say "ready: $root ($(du -sh "$root" | cut -f1))"
echo "$root"
