"""A pipeline stage's step with per-variable gradients vs one flat gradient tensor.

Run: .venv/bin/python benchmarks/stage_gradients.py [--depths 110,20] [--rounds 9]

One process, one TF thread. A CIFAR ResNet (the paper's shape of work) runs as a last
pipeline stage (`StageRunner` with the loss) over 4 micro-batches per step: forward and
backward of each, then the step's summed gradients handed over, as the trainer takes them
before the replica reduction. Two runners alternate on the same model and data:

- per variable: the tape differentiates every variable; each backward returns one tensor per
  variable, added to the step's total one eager op each;
- flat (what the engine runs): the stage reads its variables from views of one flat tensor
  of their values, packed once per step, and differentiates that tensor; each backward returns
  one flat gradient (the concat runs inside the compiled backward), added in one op.

Prints the median step time of each (and its spread), their ratio, and the largest
difference between the two runners' gradients (they must agree).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MICROBATCHES = 4


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="110,20", help="CIFAR ResNet depths")
    parser.add_argument("--microbatch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--rounds", type=int, default=9, help="alternating timed steps")
    return parser.parse_args(argv)


def _runners(model):
    from hyparflow.engine.flat import FlatLayout
    from hyparflow.engine.stage import StageRunner

    def runner(layout):
        return StageRunner(
            lambda inputs, training: model(inputs, training=training),
            model.trainable_variables,
            loss=lambda y, y_pred, sw: model._compile_loss(y, y_pred, sw),
            input_grads=False,  # a whole model: nothing upstream
            layout=layout,
        )

    return {"per variable": runner(None), "flat": runner(FlatLayout(model.trainable_variables))}


def _step(runner, x, y, size: int):
    for k in range(MICROBATCHES):
        part = slice(k * size, (k + 1) * size)
        runner.forward(k, x[part], (y[part], None), scale=1 / MICROBATCHES)
        runner.backward(k)
    if runner.layout is not None:
        return runner.layout.unflatten_fn(runner.take_flat_gradients())
    return runner.take_gradients()


def measure(depth: int, args) -> None:
    import numpy as np
    import tensorflow as tf

    from benchmarks.models import cifar_resnet

    model = cifar_resnet(depth)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    batch = MICROBATCHES * args.microbatch
    x = tf.random.stateless_normal((batch, 32, 32, 3), seed=(1, 2))
    y = tf.random.stateless_uniform((batch,), (3, 4), minval=0, maxval=10, dtype=tf.int32)
    runners = _runners(model)
    grads = {name: _step(r, x, y, args.microbatch) for name, r in runners.items()}  # traces
    difference = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(*grads.values()))
    seconds = {name: [] for name in runners}
    for round_ in range(args.rounds):
        names = list(runners) if round_ % 2 == 0 else list(runners)[::-1]
        for name in names:
            start = time.perf_counter()
            _step(runners[name], x, y, args.microbatch)
            seconds[name].append(time.perf_counter() - start)
    print(
        f"ResNet-{depth} as one stage: {len(model.trainable_variables)} variables, "
        f"{MICROBATCHES} micro-batches of {args.microbatch}"
    )
    for name, values in seconds.items():
        ms = [1e3 * v for v in values]
        print(
            f"  {name:>12}: {statistics.median(ms):7.1f} ms/step "
            f"(min {min(ms):.1f}, max {max(ms):.1f}, n={len(ms)})"
        )
    ratios = [f / p for f, p in zip(seconds["flat"], seconds["per variable"])]
    print(
        f"  flat / per variable: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); "
        f"largest gradient difference {difference:.1e}"
    )


def main(argv=None) -> None:
    args = _arguments(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for depth in (int(d) for d in args.depths.split(",")):
        measure(depth, args)


if __name__ == "__main__":
    main()
