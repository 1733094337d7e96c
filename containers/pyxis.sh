#!/usr/bin/env bash
# Pyxis (the SPANK plugin behind `srun --container-image`) and enroot, built from their source trees against this
# machine's Slurm (Debian 12's 22.05 and its libslurm-dev), for the dev cluster. Neither is packaged in Debian, and
# CI reaches no copy of their sources: give the trees (clones of github.com/NVIDIA/pyxis and NVIDIA/enroot).
#
#   containers/pyxis.sh build PYXIS_SRC ENROOT_SRC   build both into the state folder
#   containers/pyxis.sh status                        exit 0 when both are built there
#   containers/pyxis.sh env                           print the export line: eval "$(containers/pyxis.sh env)"
#   containers/pyxis.sh down                          remove the state folder
#
# enroot is built without its git submodules: glibc instead of musl (FORCE_GLIBC), Debian's makeself 2.4.5 (the
# version enroot pins), the system's kernel headers, and libbsd for strlcpy (glibc has it from 2.38 only). The dev
# cluster (`make dev-cluster`, Slurm 22.05) loads the plugin when it finds it here. State: ${PYXIS_DIR:-${TMPDIR:-/tmp}/slurm-ddp-pyxis}. Needs root.
set -euo pipefail

STATE="$(realpath -m -- "${PYXIS_DIR:-${TMPDIR:-/tmp}/slurm-ddp-pyxis}")"
PACKAGES=(libslurm-dev makeself libbsd-dev squashfs-tools parallel jq)

say() { echo "pyxis [$SECONDS s]: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

print_env() {
    # shellcheck disable=SC2016  # $PATH expands where the line is evaluated
    printf 'export PATH=%q:"$PATH" PYXIS_DIR=%q\n' "$STATE/bin" "$STATE"
}

built() { [[ -f "$STATE/lib/spank_pyxis.so" && -x "$STATE/bin/enroot" ]]; }

packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    ((${#missing[@]} == 0)) && return 0
    say "installing ${missing[*]}"
    apt-get install -y -q "${missing[@]}" >&2 || { apt-get update -q >&2 && apt-get install -y -q "${missing[@]}" >&2; }
}

build_pyxis() {
    local src="$1"
    make -C "$src" >&2 || die "pyxis did not build against this Slurm's spank.h (above)"
    install -D -m 755 "$src/spank_pyxis.so" "$STATE/lib/spank_pyxis.so"
}

build_enroot() {
    local src="$1"
    # The submodules' stamps, with Debian's makeself in place of deps/makeself and the system's headers in place of
    # deps/linux-headers; deps/libbsd is in the tree.
    mkdir -p "$src/deps/makeself" "$src/deps/linux-headers" "$src/deps/dist/linux/include"
    install -D -m 755 /usr/bin/makeself "$src/deps/dist/makeself/bin/enroot-makeself"
    touch "$src/deps/makeself/.stamp" "$src/deps/linux-headers/.stamp"
    rm -f "$src/enroot"  # made with the prefix of an earlier build
    # CPPFLAGS from the environment: the Makefile adds its own to it (on the command line it would replace them).
    CPPFLAGS="-D_GNU_SOURCE -include /usr/include/bsd/string.h" make -C "$src" FORCE_GLIBC=1 prefix="$STATE" \
        LDLIBS="-l:libbsd.a -l:libbsd.so.0" install >&2 || die "enroot did not build (above)"
}

cmd_build() {
    (($# == 2)) || die "usage: containers/pyxis.sh build PYXIS_SRC ENROOT_SRC"
    ((EUID == 0)) || die "needs root (packages; the plugin runs in slurmstepd)"
    local pyxis enroot
    [[ -f "$1/pyxis_slurmstepd.c" ]] || die "$1 is not a pyxis source tree (no pyxis_slurmstepd.c)"
    [[ -f "$2/enroot.in" ]] || die "$2 is not an enroot source tree (no enroot.in)"
    packages
    mkdir -p "$STATE/src"
    rm -rf "$STATE/src/pyxis" "$STATE/src/enroot"
    cp -a "$1" "$STATE/src/pyxis" && cp -a "$2" "$STATE/src/enroot"
    pyxis="$STATE/src/pyxis" enroot="$STATE/src/enroot"
    build_pyxis "$pyxis"
    build_enroot "$enroot"
    built || die "the build left no plugin or no enroot in $STATE"
    say "built: $STATE/lib/spank_pyxis.so, $("$STATE/bin/enroot" version) (restart the dev cluster to load it)"
}

case "${1:-}" in
    build) shift; cmd_build "$@" ;;
    status) built ;;
    env) print_env ;;
    down) rm -rf "$STATE" ;;
    *) die "usage: containers/pyxis.sh build PYXIS_SRC ENROOT_SRC | status | env | down" ;;
esac
