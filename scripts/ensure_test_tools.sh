#!/usr/bin/env bash
# System tools the tests use besides MPI: a real single-node Slurm (slurm-wlm + munge).
set -euo pipefail
source "$(dirname "$0")/apt_tools.sh"
if ensure_tools "Slurm for the tests" "slurmctld munged" "slurm-wlm munge"; then
  exit 0
fi
echo "hyparflow: the Slurm tests need slurm-wlm and munge (apt-get install slurm-wlm munge)." >&2
exit 1
