#!/usr/bin/env bash
# `make image`: the CPU image from containers/recipe.py, built here with Charliecloud
# (docs/containers.md). No registry serves a base image on this machine, so the base is a
# Debian 12 root made with debootstrap from the mirror apt uses, and the recipe is generated
# with `--userarg base=...` on it. Writes build/hyparflow-cpu/ (a directory image) and
# build/hyparflow-cpu.sqfs (SquashFS, what Apptainer and Singularity also run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/apt_tools.sh

OUT=build
WORK=$OUT/image               # the base root, the generated Dockerfile, ch-image's storage
IMAGE=hyparflow-cpu
BASE=local/debian12           # the base's name in ch-image's storage (and the recipe's FROM)
SUITE=bookworm
export USER=${USER:-$(id -un)}  # ch-image needs it; a root shell may not set it
export CH_IMAGE_STORAGE=$PWD/$WORK/storage
start=$SECONDS

# Debian's ch-image runs `env python3` and needs its python3-lark, not another Python on PATH.
ch() { PATH=/usr/bin:$PATH "$@"; }

ensure_builders() {
  ensure_tools "Charliecloud" "ch-image ch-run ch-convert debootstrap mksquashfs" \
    "charliecloud charliecloud-builders python3-lark debootstrap squashfs-tools" && return
  echo "hyparflow: make image needs Charliecloud, debootstrap and squashfs-tools" >&2
  echo "  (Debian/Ubuntu as root: apt-get install charliecloud charliecloud-builders" \
    "debootstrap squashfs-tools)" >&2
  exit 1
}

# The first URI of the host's Debian sources: the mirror this machine can reach.
apt_mirror() {
  local uri
  uri=$(grep -hoE '^(URIs:|deb) +[a-z]+://[^ ]+' /etc/apt/sources.list.d/*.sources \
    /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1 | awk '{print $2}')
  echo "${uri:-http://deb.debian.org/debian}"
}

# hpccm in a venv of its own: the image must not depend on the development venv.
generate_dockerfile() {
  local tools=$OUT/hpccm-venv
  [ -x $tools/bin/hpccm ] || { python3 -m venv $tools && $tools/bin/pip install -q 'hpccm>=26.5'; }
  $tools/bin/hpccm --recipe containers/recipe.py --userarg variant=cpu base=$BASE \
    --format docker > $WORK/Dockerfile
}

# What the image must share with the host to reach the same package index: the Debian sources
# (the same versions as the host's, Open MPI included), pip's configuration, and the local
# certificate authorities that pip's and apt's TLS trust here (update-ca-certificates keeps them).
host_settings_into() {
  local root=$1
  [ -f /etc/apt/sources.list.d/debian.sources ] &&
    cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/" &&
    rm -f "$root/etc/apt/sources.list"
  [ -f /etc/pip.conf ] && cp /etc/pip.conf "$root/etc/pip.conf"
  mkdir -p "$root/usr/local/share/ca-certificates" "$root/etc/ssl/certs"
  cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  # the bundle itself too, for pip.conf's `cert =` before the image installs ca-certificates
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  return 0
}

make_base() {
  local root=$WORK/base
  rm -rf "$root"
  echo "hyparflow: debootstrap $SUITE from $(apt_mirror) (about a minute)"
  debootstrap --variant=minbase $SUITE "$root" "$(apt_mirror)" > $WORK/debootstrap.log
  # ch-run binds the host's /dev; ch-image would copy device nodes as files
  rm -rf "${root:?}"/dev/*
  host_settings_into "$root"
  ch ch-image --no-cache import "$root" $BASE
  rm -rf "$root"
}

# --force: apt-get as root in the container's namespace (one user mapped) through fakeroot.
build_image() {
  ch ch-image --no-cache build --force -f $WORK/Dockerfile -t $IMAGE .
  rm -rf "${OUT:?}/$IMAGE" "$OUT/$IMAGE.sqfs"
  ch ch-convert -i ch-image -o dir $IMAGE "$OUT/$IMAGE"
  ch ch-convert -i dir -o squash "$OUT/$IMAGE" "$OUT/$IMAGE.sqfs"
  rm -rf "$CH_IMAGE_STORAGE"  # the directory image is the copy kept
}

ensure_builders
rm -rf "$WORK" && mkdir -p "$WORK"
generate_dockerfile
make_base
build_image
seconds=$((SECONDS - start))
echo $seconds > "$OUT/$IMAGE.build-seconds"
echo "hyparflow: built $OUT/$IMAGE/ ($(du -sh "$OUT/$IMAGE" | cut -f1)) and $OUT/$IMAGE.sqfs" \
  "($(du -sh "$OUT/$IMAGE.sqfs" | cut -f1)) in ${seconds}s"
