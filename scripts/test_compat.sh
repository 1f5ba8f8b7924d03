#!/usr/bin/env bash
# make test-compat: a second venv with TensorFlow 2.17, tensorflow-io and Horovod, and the tests
# that need them (Horovod backend, tensorflow-io input) plus a smoke subset of the main suite.
#
# Usage: scripts/test_compat.sh [--setup-only | PYTEST ARGS...]
# Each setup step runs once and leaves a stamp in the venv; a rerun only runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HYPARFLOW_COMPAT_VENV:-.venv-compat}
PY=$VENV/bin/python
# tensorflow-io 0.37.1's ops load only with TF 2.16-2.17; TF 2.17 ships Keras 3 and needs
# numpy < 2 (pip resolves both from these pins).
PINS=("tensorflow==2.17.1" "tensorflow-io==0.37.1")
HOROVOD_VERSION=0.28.1
TESTS=(
  tests/test_horovod.py
  tests/test_tfio.py
  tests/test_strategy.py
  tests/test_schedule.py
  tests/test_private_keras.py
  "tests/test_engine.py::test_two_ranks_match_keras"
)

# Open MPI: allow root, allow more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 TF_CPP_MIN_LOG_LEVEL=2

stamp() { echo "$VENV/.stamp-$1-$(echo "$2" | md5sum | cut -c1-12)"; }

scripts/ensure_mpi.sh
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
  echo '*' >"$VENV/.gitignore" # keep the venv out of git and of ruff
fi

deps=$(stamp deps "${PINS[*]}")
if [ ! -e "$deps" ]; then
  echo "test-compat: installing ${PINS[*]} into $VENV" >&2
  "$PY" -m pip install -q "${PINS[@]}"
  touch "$deps"
fi

horovod=$(stamp horovod "$HOROVOD_VERSION ${PINS[*]} $(md5sum <scripts/build_horovod.sh)")
if [ ! -e "$horovod" ]; then
  scripts/build_horovod.sh "$PY"
  touch "$horovod"
fi

project=$VENV/.stamp-hyparflow
if [ ! -e "$project" ] || [ pyproject.toml -nt "$project" ]; then
  echo "test-compat: installing hyparflow (editable) into $VENV" >&2
  "$PY" -m pip install -q -e '.[test,io]'
  touch "$project"
fi

"$PY" -c 'import tensorflow as tf, keras, horovod
print(f"test-compat: TensorFlow {tf.__version__}, Keras {keras.__version__}, "
      f"Horovod {horovod.__version__}")'
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi
exec "$PY" -m pytest -p no:cacheprovider "${TESTS[@]}" "$@"
