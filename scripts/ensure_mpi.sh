#!/usr/bin/env bash
# Use the system Open MPI; install it with apt when missing and we are root on Debian/Ubuntu.
set -euo pipefail
source "$(dirname "$0")/apt_tools.sh"
if ensure_tools "Open MPI" "mpirun mpicc" "openmpi-bin libopenmpi-dev"; then
  exit 0
fi
cat >&2 <<'MSG'
hyparflow: no MPI found (mpirun/mpicc not on PATH).
  On a cluster:   module load openmpi   (or your site's MPI module), then rerun make.
  On Debian/Ubuntu as root:  apt-get install openmpi-bin libopenmpi-dev
MSG
exit 1
