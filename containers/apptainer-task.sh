#!/usr/bin/env bash
# One Slurm task inside Apptainer: `srun containers/apptainer-task.sh [APPTAINER_EXEC_OPTION...] -- IMAGE CMD...`.
#
# A SIF file is run from a copy unpacked once per node into node-local storage, not mounted. Without setuid,
# Apptainer mounts a SIF with squashfuse, a process of the job step; Slurm's warning signal (--signal, scancel
# --signal) and a preemption's SIGTERM reach every process of the step, squashfuse among them: it dies, the image's
# files vanish under the running tasks, and they fail with SIGBUS just as they save. An unpacked image needs no FUSE
# process, and tasks start from it faster. The copy is keyed by the image's path, size and time, so the node's other
# tasks, later attempts and later jobs reuse it; TRAINER_IMAGE_CACHE picks the place (default: $TMPDIR or /tmp).
# Any other image (docker://…, a sandbox folder) is passed to `apptainer exec` as it is.
set -euo pipefail
opts=()
while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
[[ $# -ge 2 ]] || { echo "usage: $0 [apptainer exec options] -- IMAGE CMD..." >&2; exit 2; }
shift
image=$1
shift

unpacked() {  # the node-local copy of SIF file $1, unpacked by the first task that needs it
    local sif dir offset
    sif=$(realpath "$1")
    dir="${TRAINER_IMAGE_CACHE:-${TMPDIR:-/tmp}}/trainer-image-$(stat -c '%n %s %Y' "$sif" | md5sum | cut -c1-16)"
    if [[ ! -f $dir/.unpacked ]]; then
        mkdir -p "$(dirname "$dir")"
        exec 9>"$dir.lock"
        flock 9  # the node's other tasks (and jobs) wait for one unpacking
        if [[ ! -f $dir/.unpacked ]]; then
            # The SIF's root file system is a squashfs partition at an offset (`apptainer sif list` names it).
            offset=$(apptainer sif list "$sif" | awk -F'|' '/Squashfs/ {split($4, at, "-"); print at[1] + 0; exit}')
            [[ -n $offset ]] || { echo "error: container.image: $sif holds no squashfs partition" >&2; exit 2; }
            rm -rf "$dir" "$dir.part"
            unsquashfs -q -no-progress -o "$offset" -d "$dir.part" "$sif" >/dev/null ||
                { echo "error: container.image: cannot unpack $sif into $dir.part on $(hostname) (space?)" >&2; exit 1; }
            touch "$dir.part/.unpacked"
            mv "$dir.part" "$dir"
        fi
        exec 9>&-
    fi
    echo "$dir"
}

if [[ -f $image && $(dd if="$image" bs=1 skip=32 count=9 2>/dev/null) == SIF_MAGIC ]]; then
    image=$(unpacked "$image")
fi
exec apptainer exec "${opts[@]}" "$image" "$@"
