#!/usr/bin/env bash
# System tools the tests use besides MPI: a real single-node Slurm (slurm-wlm + munge).
set -euo pipefail
if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "hyparflow: installing Slurm for the tests (slurm-wlm munge) with apt-get" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  exit 0
fi
echo "hyparflow: the Slurm tests need slurm-wlm and munge (apt-get install slurm-wlm munge)." >&2
exit 1
