#!/usr/bin/env bash
# Build a LOCAL base image that stands in for the CUDA PyTorch images, which
# cannot be pulled here (no container registry): Debian bookworm (minbase) +
# python3 + pip + a CPU build of torch and numpy, installed system-wide.
#
#   containers/test-base.sh [TAG]          default TAG: slurm-ddp-test-base:bookworm
#   docker build --build-arg BASE_IMAGE=TAG -f containers/Dockerfile .
#
# If TAG already exists in the engine it does nothing (CI may call it twice).
# Engine: $DOCKER_HOST if set, else the private one of containers/engine.sh
# (start it first with `containers/engine.sh up`). Needs root (debootstrap, chroot).
#
# Settings (environment):
#   TORCH_SPEC   torch requirement            (default torch==2.13.0)
#   WHEEL_DIR    wheel cache kept between runs (default ${TMPDIR:-/tmp}/slurm-ddp-wheels;
#                empty: no cache)
#   DEBIAN_MIRROR                              (default http://deb.debian.org/debian)
#   HOST_CAS     1: trust the host's site CAs in the image too (default 1)
#   IMAGE_CACHE  folder that keeps the built image as a `docker save` archive, named by what went into it (this
#                script, TORCH_SPEC, the mirror, HOST_CAS), and loads it next time instead of building: a
#                fresh engine (CI's) then has it in half a minute, as a registry pull would give it
#                (default /var/cache/slurm-ddp-roots, beside the dev clusters' Debian roots; empty: no cache)
set -euo pipefail

TAG="${1:-slurm-ddp-test-base:bookworm}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WHEEL_DIR="${WHEEL_DIR-${TMPDIR:-/tmp}/slurm-ddp-wheels}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HOST_CAS="${HOST_CAS:-1}"
IMAGE_CACHE="${IMAGE_CACHE-/var/cache/slurm-ddp-roots}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { printf 'test-base [%3d s]: %s\n' "$SECONDS" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ -z ${DOCKER_HOST:-} ]]; then
  # Also sets DOCKER_API_VERSION and DOCKER_BUILDKIT for that engine.
  eval "$("$HERE/engine.sh" env)"
fi
docker info >/dev/null 2>&1 \
  || die "no container engine answers at $DOCKER_HOST (run: containers/engine.sh up)"

if docker image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG already exists; nothing to do (docker rmi $TAG to rebuild)"
  exit 0
fi

cached=""
if [[ -n $IMAGE_CACHE ]]; then
  key="$({ cat "${BASH_SOURCE[0]}"; echo "$TORCH_SPEC $MIRROR $HOST_CAS"; } | sha256sum | cut -c1-16)"
  cached="$IMAGE_CACHE/test-base-$key.tar"
  if [[ -f $cached ]] && docker load -i "$cached" >/dev/null && docker tag "slurm-ddp-test-base:$key" "$TAG"; then
    docker rmi "slurm-ddp-test-base:$key" >/dev/null  # the tag only: the image stays as $TAG
    log "loaded $TAG from $cached in $SECONDS s"
    exit 0
  fi
fi
((EUID == 0)) || die "needs root (debootstrap, chroot)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/slurm-ddp-test-base.XXXXXX")"
ROOTFS="$WORK/rootfs"
cleanup() {
  # debootstrap mounts proc/sys (and may bind-mount /dev) inside the target and
  # leaves them if it fails: unmount before deleting, deepest first, and never
  # let rm cross into a mount (--one-file-system).
  local mnt
  log "removing temporary files ($WORK)"
  while read -r mnt; do
    umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  done < <(awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r)
  rm -rf --one-file-system -- "$WORK"
}
trap cleanup EXIT

# Wheels, fetched on the host with the host's pip (its config may point at local
# indexes) but for the image's interpreter, not the host's: bookworm has CPython
# 3.11 on glibc 2.36. pip does not widen a manylinux_2_36 platform to older
# glibc tags by itself, so every one is listed.
TARGET=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311
  --platform manylinux2014_x86_64)
for ((minor = 36; minor >= 17; minor--)); do
  TARGET+=(--platform "manylinux_2_${minor}_x86_64")
done
if [[ -n $WHEEL_DIR ]]; then
  mkdir -p "$WHEEL_DIR"
  TARGET+=(--find-links "$WHEEL_DIR")
fi
command -v python3 >/dev/null || die "python3 with pip is needed on the host to fetch wheels"
mkdir -p "$WORK/wheels"
log "fetching $TORCH_SPEC"
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$WORK/wheels" "$TORCH_SPEC" >&2
torch_whl="$(find "$WORK/wheels" -name 'torch-*.whl')"
[[ -f $torch_whl ]] || die "pip download $TORCH_SPEC gave no single torch wheel"
size_mb=$(($(stat -c %s "$torch_whl") / 1048576))
# A CUDA build would pull gigabytes of nvidia-* wheels into a test image that
# never sees a GPU: accept only a CPU build (+cpu, a few hundred MB).
if [[ $torch_whl != *+cpu* ]] || ((size_mb > 1024)); then
  die "$(basename "$torch_whl") ($size_mb MB) is not a CPU build; point pip at one," \
    "e.g. PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
fi
log "torch wheel: $(basename "$torch_whl") ($size_mb MB)"
# torch's own requirements (filelock, typing-extensions, setuptools, sympy,
# networkx, jinja2, fsspec, ...) as its metadata lists them, plus numpy.
python3 -m pip download -q "${TARGET[@]}" -d "$WORK/wheels" "$torch_whl" numpy >&2
if [[ -n $WHEEL_DIR ]]; then
  for whl in "$WORK"/wheels/*.whl; do
    [[ -e $WHEEL_DIR/${whl##*/} ]] || cp "$whl" "$WHEEL_DIR/"
  done
fi

if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap"
  apt-get install -y -q debootstrap >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q debootstrap >&2; }
fi
log "debootstrap bookworm (minbase) from $MIRROR"
# minbase: only essential packages + apt; python3-pip brings python3.
debootstrap --variant=minbase --include=ca-certificates,python3,python3-pip \
  bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }

# Install inside the rootfs with its own pip, from the wheels only (no network):
# that puts torch where a container's `pip install` would (/usr/local/lib).
log "installing torch + numpy into the rootfs"
mkdir -p "$ROOTFS/tmp/wheels"
mv "$WORK"/wheels/*.whl "$ROOTFS/tmp/wheels/"
chroot "$ROOTFS" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root python3 -m pip install -q --no-cache-dir --no-index --break-system-packages \
  --root-user-action=ignore --find-links /tmp/wheels "/tmp/wheels/$(basename "$torch_whl")" \
  numpy >&2

# Site CAs the host trusts (Debian keeps them in /usr/local/share/ca-certificates),
# e.g. an HTTPS-inspecting proxy's: without them pip/apt-over-https in containers
# fail with CERTIFICATE_VERIFY_FAILED where the host succeeds. Certificates are
# public; this is a local image that is never pushed.
shopt -s nullglob
host_cas=(/usr/local/share/ca-certificates/*.crt)
shopt -u nullglob
if [[ $HOST_CAS == 1 ]] && ((${#host_cas[@]})); then
  log "adding the host's site CAs: ${host_cas[*]##*/}"
  cp "${host_cas[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates >/dev/null
fi

log "importing the rootfs as $TAG"
# Excluded: /dev contents (device nodes would be copied as plain files -- a
# copied /dev/full fills the disk; docker provides /dev at run time), /proc and
# /sys contents, /tmp (the wheels), apt's package cache and lists (a container
# runs apt-get update first anyway). --numeric-owner: ids as in the rootfs, not
# as the host's passwd maps the names.
tar -C "$ROOTFS" --numeric-owner --one-file-system \
  --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' --exclude='./tmp/*' \
  --exclude='./var/cache/apt/*' --exclude='./var/lib/apt/lists/*' \
  --exclude='./root/.cache' -c . \
  | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'ENV PIP_NO_CACHE_DIR=1' \
    --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
    --change 'ENV PIP_ROOT_USER_ACTION=ignore' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'LABEL org.opencontainers.image.description="slurm-ddp test base: bookworm + python3 + CPU torch"' \
    --change 'CMD ["python3"]' \
    --message "containers/test-base.sh: bookworm minbase + $(basename "$torch_whl")" \
    - "$TAG" >/dev/null
# PIP_BREAK_SYSTEM_PACKAGES: Debian marks its python as externally managed
# (PEP 668); images built on this one `pip install` as root, like the CUDA
# PyTorch images allow. REQUESTS_CA_BUNDLE: pip-installed requests (wandb)
# would use certifi's bundle, which lacks the site CAs added above.

log "checking: python3 -c 'import torch, numpy'"
docker run --rm --network host "$TAG" python3 -c \
  'import numpy, torch; print("torch", torch.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())' >&2 \
  || { docker rmi "$TAG" >/dev/null 2>&1 || true; die "the new image cannot import torch; removed it"; }
log "built $TAG in $SECONDS s, $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
if [[ -n $cached ]] && mkdir -p "$IMAGE_CACHE"; then
  # Saved under a tag of its own (the key), written aside and renamed: a half-written archive is never loaded.
  docker tag "$TAG" "slurm-ddp-test-base:$key"
  if docker save "slurm-ddp-test-base:$key" -o "$cached.part.$$" && mv "$cached.part.$$" "$cached"; then
    log "kept as $cached"
  else
    rm -f "$cached.part.$$"
  fi
  docker rmi "slurm-ddp-test-base:$key" >/dev/null
fi
