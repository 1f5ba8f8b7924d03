#!/usr/bin/env bash
# Build Horovod 0.28.1 from source (MPI, TensorFlow only) against the TensorFlow of a Python.
#
# Usage: scripts/build_horovod.sh [PYTHON]      (default: the python3 on PATH)
# Needs a C++ compiler and an MPI with its headers (mpicc); cmake comes from pip.
# See docs/horovod.md for what this does and why.
set -euo pipefail

PY=${1:-python3}
VERSION=0.28.1

export TF_CPP_MIN_LOG_LEVEL=3 # no CUDA noise from the version probes
tf_version=$("$PY" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null) || {
  echo "build_horovod: $PY cannot import tensorflow; install TensorFlow first" >&2
  exit 1
}
# pip puts cmake here; the build finds it on PATH.
scripts_dir=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "build_horovod: Horovod $VERSION for TensorFlow $tf_version ($PY)" >&2
# --no-build-isolation builds against the installed TensorFlow, so its build needs are ours.
"$PY" -m pip install -q setuptools wheel packaging cloudpickle psutil pyyaml cmake
"$PY" -m pip download -q --no-binary :all: --no-deps "horovod==$VERSION" -d "$work"
tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"

# TensorFlow 2.19 moved the XLA headers that xla_mpi_ops.cc includes. Those ops serve GPU
# builds only, so on CPU guarding the includes with HAVE_GPU too is the whole fix (the last
# Horovod release predates TF 2.19).
if "$PY" -c 'import sys, tensorflow as tf
sys.exit(tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 19))'; then
  file="$src/horovod/tensorflow/xla_mpi_ops.cc"
  sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/& \&\& HAVE_GPU/' "$file"
  grep -q '^#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU$' "$file" || {
    echo "build_horovod: could not patch $file (its guard line changed?)" >&2
    exit 1
  }
  echo "build_horovod: patched xla_mpi_ops.cc for TensorFlow >= 2.19 (CPU build)" >&2
fi

PATH="$scripts_dir:$PATH" \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
  "$PY" -m pip install -q --no-build-isolation --no-cache-dir "$src"

"$PY" - <<'CHECK'
import horovod
import horovod.tensorflow as hvd

assert hvd.mpi_built(), "Horovod was built without MPI"
print(f"build_horovod: horovod {horovod.__version__} with TensorFlow and MPI imports")
CHECK
