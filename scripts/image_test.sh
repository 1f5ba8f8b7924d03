#!/usr/bin/env bash
# `make image-test`: checks inside build/hyparflow-cpu (made by `make image`), launched the way
# clusters run containers: the host's mpirun starts `ch-run IMAGE -- python ...` on each rank and
# the image's Open MPI joins it (docs/containers.md). Fails when the 4-rank hybrid demo inside
# the image prints other losses than the same demo outside it.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=build/hyparflow-cpu
LOGS=build/image-test
HOST_PY=.venv/bin/python  # `make setup`'s venv: the runs outside the image
export USER=${USER:-$(id -un)} TF_CPP_MIN_LOG_LEVEL=2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# What `hyparflow run -n 4 --oversubscribe` sets on this 2-core machine (one thread a rank):
# inside and outside must compute alike for their losses to match.
export TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 OMP_NUM_THREADS=1
MPIRUN=(mpirun --oversubscribe --bind-to none)

# `in_image IMAGE DIR CMD...`: CMD in the image, DIR bound at /mnt and the working directory;
# --set-env applies the image's ENV (its venv first on PATH) over the host's environment.
in_image() {
  local image=$1 dir=$2
  shift 2
  ch-run --set-env -b "$dir:/mnt" -c /mnt "$image" -- "$@"
}

# `timed NAME CMD...`: runs CMD with its output in $LOGS/NAME.log; prints its seconds.
timed() {
  local name=$1 start=$SECONDS
  shift
  echo "--- $name: $*" >&2
  if ! "$@" > "$LOGS/$name.log" 2>&1; then
    tail -n 30 "$LOGS/$name.log" >&2
    echo "image-test: $name failed (log: $LOGS/$name.log)" >&2
    exit 1
  fi
  echo $((SECONDS - start))
}

# The loss at the end of each epoch: Keras's progress bar at step N/N. Its updates in between
# are throttled by time, so only the last step's are comparable between runs.
losses() {
  sed 's/\x1b\[[0-9;]*m//g' "$LOGS/$1.log" | tr '\r' '\n' | grep -E '^ *([0-9]+)/\1 .* loss: ' |
    grep -oE ' loss: [0-9.]+' | awk '{print $2}' | uniq
}
final_loss() { grep -oE 'final loss: [0-9.e-]+' "$LOGS/$1.log" | awk '{print $3}'; }

same() {  # `same WHAT EXPECTED GOT`: fails unless the two are equal and not empty
  if [ -z "$2" ] || [ "$2" != "$3" ]; then
    printf 'image-test: %s differ:\n  expected: %s\n  got:      %s\n' "$1" "$2" "$3" >&2
    exit 1
  fi
}

check_image() {
  [ -d "$IMAGE" ] && [ -f "$IMAGE.sqfs" ] || {
    echo "image-test: no $IMAGE: run make image first" >&2
    exit 1
  }
  echo "image: $IMAGE $(du -sh "$IMAGE" | cut -f1), $IMAGE.sqfs $(du -sh "$IMAGE.sqfs" | cut -f1)," \
    "built in $(cat "$IMAGE.build-seconds" 2>/dev/null || echo '?')s"
  local python host_mpi image_mpi
  python=$(in_image "$IMAGE" "$PWD" sh -c 'command -v python')
  same "first python on the image's PATH" /opt/venv/bin/python "$python"
  host_mpi=$(ompi_info --version | head -n1)
  image_mpi=$(in_image "$IMAGE" "$PWD" ompi_info --version | head -n1)
  same "Open MPI versions (host, image)" "$host_mpi" "$image_mpi"
  echo "python $python; $image_mpi in the image and on the host"
}

# A script the image never saw, bound in from a fresh folder: one process (directory image and
# SquashFS file), then 2 ranks under the host's mpirun against the same 2 ranks outside.
check_bound_script() {
  local dir
  dir=$(mktemp -d)
  cp scripts/image_fit_check.py "$dir/fit.py"
  timed help in_image "$IMAGE" "$dir" hyparflow --help > /dev/null
  echo "single process: $(timed fit-1 in_image "$IMAGE" "$dir" python fit.py)s," \
    "loss $(final_loss fit-1)"
  echo "single process from $IMAGE.sqfs: $(timed fit-sqfs in_image "$IMAGE.sqfs" "$dir" python fit.py)s," \
    "loss $(final_loss fit-sqfs)"
  timed fit-2-outside env PYTHONPATH="$PWD" "${MPIRUN[@]}" -np 2 $HOST_PY "$dir/fit.py" > /dev/null
  timed fit-2-inside "${MPIRUN[@]}" -np 2 ch-run --set-env -b "$dir:/mnt" -c /mnt "$IMAGE" -- \
    python fit.py > /dev/null
  same "2-rank losses of the bound script" "$(final_loss fit-2-outside)" "$(final_loss fit-2-inside)"
  echo "bound script on 2 ranks: loss $(final_loss fit-2-inside) inside and outside;" \
    "inside: $(grep -h '^python' "$LOGS/fit-2-inside.log")"
  rm -rf "$dir"
}

# examples/demo.py, 2 stages x 2 replicas: as `make demo` runs it, then inside the image.
check_demo() {
  local outside inside nodes
  outside=$(timed demo-outside env PYTHONPATH="$PWD" .venv/bin/hyparflow run -n 4 --oversubscribe \
    examples/demo.py)
  inside=$(timed demo-inside "${MPIRUN[@]}" -np 4 ch-run --set-env -b "$PWD/examples:/mnt" -c /mnt \
    "$IMAGE" -- python demo.py)
  nodes=$(timed demo-nodes scripts/emulated_nodes.sh nodeA:2,nodeB:2 -np 4 --oversubscribe \
    --bind-to none ch-run --set-env -b "$PWD/examples:/mnt" -c /mnt "$IMAGE" -- python demo.py)
  same "4-rank demo losses (inside the image)" "$(losses demo-outside | xargs)" "$(losses demo-inside | xargs)"
  same "4-rank demo losses (2 emulated nodes)" "$(losses demo-outside | xargs)" "$(losses demo-nodes | xargs)"
  echo "demo on 4 ranks, losses per epoch: $(losses demo-inside | xargs)"
  echo "  outside ${outside}s, inside ${inside}s, inside on 2 emulated nodes ${nodes}s"
  grep -h '^Trained' "$LOGS"/demo-{outside,inside,nodes}.log
}

mkdir -p "$LOGS"
check_image
check_bound_script
check_demo
echo "image-test: passed"
