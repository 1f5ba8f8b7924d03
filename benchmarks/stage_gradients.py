"""A pipeline stage's step with per-variable gradients vs one flat gradient tensor.

Run: .venv/bin/python benchmarks/stage_gradients.py [--models resnet110,resnet20,mlp1024]
     [--rounds 9]

One process, one TF thread. A model runs as a last pipeline stage (`StageRunner` with the
loss) over 4 micro-batches per step: forward and backward of each, then the step's summed
gradients handed over as one flat tensor, as the trainer takes them before the replica
reduction. Three runners alternate on the same model and data:

- per variable: the tape differentiates every variable; each backward returns one tensor per
  variable, added to the step's total one eager op each; the total is concatenated into the
  flat tensor once, when taken (`flat_backward=False`);
- flat backward: the stage reads its variables from views of one flat tensor of their
  values, packed once per step, and differentiates that tensor; each backward returns one
  flat gradient (the concat runs inside the compiled backward), added in one op;
- auto: what the engine picks (`FlatLayout.flat_backward_pays`).

Models: CIFAR ResNets (`resnetN`: many small variables, the paper's shape of work) and the
pipeline figure's MLP (`mlpW`: two Dense(W) layers and a head, few large variables).
Prints the median step time of each (and its spread), the ratios to per variable, and the
largest difference between the runners' gradients (they must agree).
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
    parser.add_argument("--models", default="resnet110,resnet20,mlp1024", help="models to run")
    parser.add_argument("--microbatch", type=int, default=0, help="samples per micro-batch "
                        "(default: 4 for ResNets, 32 for MLPs)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=9, help="alternating timed steps")
    return parser.parse_args(argv)


def _runners(model):
    from hyparflow.engine.flat import FlatLayout
    from hyparflow.engine.stage import StageRunner

    layout = FlatLayout(model.trainable_variables)

    def runner(flat_backward):
        return StageRunner(
            lambda inputs, training: model(inputs, training=training),
            model.trainable_variables,
            loss=lambda y, y_pred, sw: model._compile_loss(y, y_pred, sw),
            input_grads=False,  # a whole model: nothing upstream
            layout=layout,
            flat_backward=flat_backward,
        )

    return {
        "per variable": runner(False),
        "flat backward": runner(True),
        "auto": runner(layout.flat_backward_pays),
    }


def _step(runner, x, y, size: int):
    for k in range(MICROBATCHES):
        part = slice(k * size, (k + 1) * size)
        runner.forward(k, x[part], (y[part], None), scale=1 / MICROBATCHES)
        runner.backward(k)
    return runner.take_flat_gradients()


def _model_and_data(name: str, microbatch: int):
    import tensorflow as tf

    from benchmarks.models import cifar_resnet, mlp

    if name.startswith("resnet"):
        model = cifar_resnet(int(name[len("resnet") :]))
        model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
        size = microbatch or 4
        shape = (32, 32, 3)
    elif name.startswith("mlp"):
        width = int(name[len("mlp") :])
        model, size, shape = mlp(width, 2), microbatch or 32, (width,)
    else:
        raise SystemExit(f"unknown model {name!r}: resnetN or mlpW")
    batch = MICROBATCHES * size
    x = tf.random.stateless_normal((batch, *shape), seed=(1, 2))
    y = tf.random.stateless_uniform((batch,), (3, 4), minval=0, maxval=10, dtype=tf.int32)
    return model, x, y, size


def measure(name: str, args) -> None:
    import numpy as np

    model, x, y, size = _model_and_data(name, args.microbatch)
    runners = _runners(model)
    grads = {key: _step(r, x, y, size).numpy() for key, r in runners.items()}  # traces
    reference = grads["per variable"]
    difference = max(float(np.max(np.abs(g - reference))) for g in grads.values())
    seconds = {key: [] for key in runners}
    for round_ in range(args.rounds):
        keys = list(runners) if round_ % 2 == 0 else list(runners)[::-1]
        for key in keys:
            start = time.perf_counter()
            _step(runners[key], x, y, size).numpy()
            seconds[key].append(time.perf_counter() - start)
    variables = model.trainable_variables
    megabytes = sum(int(np.prod(v.shape)) for v in variables) * 4 / 2**20
    print(
        f"{name} as one stage: {len(variables)} variables, {megabytes:.1f} MiB, "
        f"{MICROBATCHES} micro-batches of {size}; auto picks "
        f"{'flat backward' if runners['auto'].flat_backward else 'per variable'}"
    )
    for key, values in seconds.items():
        ms = [1e3 * v for v in values]
        print(
            f"  {key:>13}: {statistics.median(ms):7.1f} ms/step "
            f"(min {min(ms):.1f}, max {max(ms):.1f}, n={len(ms)})"
        )
    for key in ("flat backward", "auto"):
        ratios = [a / b for a, b in zip(seconds[key], seconds["per variable"])]
        print(
            f"  {key} / per variable: {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )
    print(f"  largest gradient difference {difference:.1e}")


def main(argv=None) -> None:
    args = _arguments(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for name in args.models.split(","):
        measure(name, args)


if __name__ == "__main__":
    main()
