#!/usr/bin/env bash
# Use the system Open MPI; install it with apt when missing and we are root on Debian/Ubuntu.
set -euo pipefail
if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "hyparflow: installing Open MPI (openmpi-bin libopenmpi-dev) with apt-get" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  exit 0
fi
cat >&2 <<'MSG'
hyparflow: no MPI found (mpirun/mpicc not on PATH).
  On a cluster:   module load openmpi   (or your site's MPI module), then rerun make.
  On Debian/Ubuntu as root:  apt-get install openmpi-bin libopenmpi-dev
MSG
exit 1
