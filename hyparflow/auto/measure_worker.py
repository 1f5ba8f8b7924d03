"""One rank of `plan --auto --measure`: train MODEL under one layout a few steps, time them.

Run by `measure_launch` as `python -m hyparflow.cli _measure-worker ...` on every rank: the
CLI hands `main` hf.fit, which this layer (below `api`) may not import. The model is loaded as
the planner loaded it and keeps its own compile; inputs are random arrays of its input shapes
made as the planner's profile makes them, targets zeros its loss takes. After `--warmup` steps
(tracing), `--steps` steps are timed from one step's end to the next (Keras's work between
steps counts), and rank 0 writes the median step's samples/s as JSON to `--out`, or the error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

from hyparflow.auto.measure import median_rate
from hyparflow.comm.world import rank
from hyparflow.strategy import Strategy

COMMAND = "_measure-worker"  # the CLI's hidden word for this module's `main`


def main(argv: list[str], fit) -> int:
    """Train and time one layout with `fit` (hf.fit); rank 0 writes the outcome to `--out`.
    An error is written too, then raised, so the launcher ends every rank."""
    args = _parser().parse_args(argv)
    try:
        seconds = _timed_steps(args, fit)
    except Exception as error:
        from hyparflow.comm.failure import _first_line  # as a failed rank says it on stderr

        _write(args.out, {"error": _first_line(error)})
        raise
    rate = median_rate(args.batch, seconds)
    _write(args.out, {"samples_per_second": rate, "step_seconds": seconds})
    return 0


def _timed_steps(args, fit) -> list[float]:
    """Seconds of each of the `args.steps` steps after `args.warmup` untimed ones."""
    from hyparflow.partitioner.source import load_model

    model = load_model(args.source, args.custom_objects)
    if getattr(model, "optimizer", None) is None:
        raise ValueError(f"{args.source} is not compiled: --measure trains with its own compile")
    samples = args.batch * (args.warmup + args.steps)
    x, y = _synthetic(model, samples, args.batch, args.input_shape)
    ends = []
    strategy = Strategy(**json.loads(args.strategy))
    fit(
        model,
        x,
        y,
        batch_size=args.batch,
        epochs=1,
        verbose=0,
        strategy=strategy,
        callbacks=[_step_timer(ends)],
    )
    timed = ends[args.warmup - 1 :]  # from the last warm-up step's end
    return [later - earlier for earlier, later in itertools.pairwise(timed)]


def _synthetic(model, samples: int, batch: int, input_shape):
    """Inputs of the model's shapes as the planner's profile makes them (random floats, zero
    indices), and zero targets of its output that its loss takes (class indices for a sparse
    loss), `samples` rows each; the loss is tried on one `batch`."""
    import keras
    import numpy as np

    from hyparflow.partitioner import profile
    from hyparflow.partitioner.graph import build_graph

    # the planner's own helpers, so that a model it timed trains on the same kind of data
    from hyparflow.simulate.measure import model_input, zero_targets

    shape = None if input_shape is None else tuple(input_shape)
    inputs = profile.make_sample(build_graph(model), input_shape=shape, batch_size=samples)
    x = model_input(model, [np.asarray(tensor) for tensor in inputs])
    # a batch, not one row: one row's indices broadcast against any output, in any loss
    first = keras.tree.map_structure(lambda array: array[:batch], x)
    targets = zero_targets(model, model(first, training=False), as_numpy=True)
    y = keras.tree.map_structure(lambda t: np.zeros((samples, *t.shape[1:]), t.dtype), targets)
    return x, y


def _step_timer(ends: list):
    """A callback appending each training step's end time to `ends`."""
    import keras

    class StepTimer(keras.callbacks.Callback):
        needs_batch_logs = False  # it reads no logs: the ranks share none between steps

        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    return StepTimer()


def _write(path: str, outcome: dict) -> None:
    """Rank 0 writes `outcome` (whole: a reader never sees half a file)."""
    if rank() != 0:
        return
    with open(path + ".part", "w") as file:
        json.dump(outcome, file)
    os.replace(path + ".part", path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"hyparflow {COMMAND}")
    add = parser.add_argument
    add("source", help="MODEL: a .keras file or module:function, as for plan --auto")
    add("--custom-objects")
    add("--input-shape", type=json.loads, help="a JSON list, null for unknown dimensions")
    add("--strategy", required=True, help="hf.Strategy's keyword arguments, as JSON")
    add("--batch", type=int, required=True, help="the global batch")
    add("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    add("--steps", type=int, default=5, help="timed steps")
    add("--out", required=True, help="where rank 0 writes its JSON outcome")
    return parser
