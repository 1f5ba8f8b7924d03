"""Issue 65's 100M-parameter MLP: each layout's largest rank against one process, and the save.

Run: .venv/bin/python benchmarks/sharded_memory.py [--quick] [--layouts 1,1,1 1,4,1,zero2 ...]
     (starts `mpirun` itself; 4 ranks oversubscribe 2 cores, which does not change memory)

The MLP: 1024 inputs, 3 x (Dense(16384, relu), Dense(1024)), 100.7 M parameters, Adam, MSE,
batch 32, 2 steps. Each rank's peak resident growth from before the model is built to the end
of `hf.fit`, under TensorFlow's pooled (BFC) allocator, and to the end of its last training
step ("training": the weights, gradients and optimizer state the steps hold, before the fit's
end gathers the whole model back), both as resident growth and as the most bytes TensorFlow's
allocator had in use ("allocated": tensors and variables, not numpy's or MPI's buffers, nor
what the allocator keeps pooled); then rank 0's growth while `model.save` writes the whole
model and optimizer (ordinary builds). Layouts "P,R,T[,flags]": "zero" (ZeRO-1), "zero2"
(ZeRO-2), "zero3" (ZeRO-3), "scope" (built under `hf.scope()`), "custom" (the same layers in a
model with its own `train_step`, the Keras guide's, which each replica runs).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402

FIGURE, MIB = "sharded_memory", 2**20
TITLE = "Memory of a 100M-parameter MLP per layout: largest rank against one process, and the save"
LAYOUTS = [
    "1,1,1",
    "1,2,1",
    "1,1,2",
    "4,1,1",
    "4,1,1,scope",
    "1,4,1",
    "1,4,1,zero",
    "1,4,1,zero2",
    "1,4,1,zero,scope",
    "1,4,1,zero2,scope",
    "1,4,1,zero3",
    "1,4,1,zero3,scope",
]
CUSTOM_LAYOUTS = ["1,1,1,custom", "1,4,1,zero2,custom", "1,4,1,zero3,custom,scope"]
POOLED = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def _strategy(spec: str):
    import hyparflow as hf

    p, r, t, *flags = spec.split(",")
    p, r, t = int(p), int(r), int(t)
    kind = "data" if p == 1 else ("model" if r == 1 else "hybrid")
    return hf.Strategy(
        kind,
        partitions=p,
        replicas=r,
        tensor=t,
        balance="params",
        shard_optimizer="zero" in flags,
        shard_gradients="zero2" in flags,
        shard_weights="zero3" in flags,
    )


def _model(width: int, scope: bool, custom: bool = False):
    import contextlib

    import keras

    import hyparflow as hf

    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.Adam(1e-4)  # before the scope (docs/big_models.md)
    kind = _own_step_model() if custom else keras.Model
    with hf.scope() if scope else contextlib.nullcontext():
        inputs = keras.Input((1024,))
        h = inputs
        for _ in range(3):
            h = keras.layers.Dense(width, activation="relu")(h)
            h = keras.layers.Dense(1024)(h)
        model = kind(inputs, h, name=f"mlp_3x{width}")
        model.compile(optimizer, "mse")
    return model


def _own_step_model():
    """A model class with the Keras guide's `train_step`: its tape, its optimizer's apply."""
    import keras
    import tensorflow as tf

    class OwnStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    return OwnStep


def worker(args) -> None:
    import os
    import tempfile

    import numpy as np
    import tensorflow as tf

    import hyparflow as hf
    from hyparflow.memory.resident import PeakGrowth

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 1024)).astype("float32")
    y = rng.normal(size=(64, 1024)).astype("float32")
    hf.size()  # MPI and TensorFlow imported before measuring
    flags = args.layout.split(",")
    scope = "scope" in flags
    tf.config.experimental.reset_memory_stats("CPU:0")
    with PeakGrowth() as growth:
        steps = _steps_peak(growth.start)
        model = _model(args.width, scope, custom="custom" in flags)
        strategy = _strategy(args.layout) if hf.size() > 1 else "data"
        hf.fit(
            model,
            x,
            y,
            batch_size=32,
            epochs=1,
            verbose=0,
            shuffle=False,
            strategy=strategy,
            callbacks=[steps],
        )
    saving = None
    if hf.rank() == 0 and not scope:  # a hf.scope() model is written by hf.export instead
        with tempfile.TemporaryDirectory() as folder, PeakGrowth() as saved:
            model.save(os.path.join(folder, "model.keras"))
        saving = saved.bytes
    write_result(
        args.worker_out,
        hf.rank(),
        {
            "growth": growth.bytes,
            "training": steps.bytes,
            "allocated": steps.allocated,
            "save": saving,
        },
    )


def _steps_peak(start: int):
    """A Keras callback holding, by the end of each training step, the peak resident growth
    above `start` (`bytes`) and the most bytes TensorFlow's allocator has had in use since
    its statistics were last reset (`allocated`: tensors and variables, not numpy's or MPI's
    buffers, nor what the allocator keeps pooled)."""
    import keras
    import tensorflow as tf

    from hyparflow.memory.resident import peak_bytes

    class StepsPeak(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.bytes = self.allocated = 0

        def on_train_batch_end(self, batch, logs=None):
            self.bytes = max(self.bytes, peak_bytes() - start)
            in_use = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            self.allocated = max(self.allocated, in_use)

    return StepsPeak()


def run(args) -> list[dict]:
    records, alone, alone_training, alone_allocated = [], None, None, None
    for spec in args.layouts:
        ranks = math.prod(int(n) for n in spec.split(",")[:3])
        results = run_worker(
            __file__, ["--layout", spec, "--width", args.width], np=ranks, env=POOLED
        )
        largest = max(r["growth"] for r in results) / MIB
        training = max(r["training"] for r in results) / MIB
        allocated = max(r["allocated"] for r in results) / MIB
        if math.prod(int(n) for n in spec.split(",")[:3]) == 1:  # one process (custom too)
            alone, alone_training, alone_allocated = largest, training, allocated
        records.append(measurement(FIGURE, f"{spec}: largest rank's growth", [largest], "MiB"))
        records.append(measurement(FIGURE, f"{spec}: largest rank's training", [training], "MiB"))
        name = f"{spec}: largest rank's training, allocated"
        records.append(measurement(FIGURE, name, [allocated], "MiB"))
        if alone is not None and ranks > 1:
            ratio = largest / alone
            records.append(measurement(FIGURE, f"{spec}: / one process", [ratio], "ratio"))
            ratio = training / alone_training
            records.append(measurement(FIGURE, f"{spec}: training / one process", [ratio], "ratio"))
            ratio = allocated / alone_allocated
            name = f"{spec}: training, allocated / one process"
            records.append(measurement(FIGURE, name, [ratio], "ratio"))
        if results[0]["save"] is not None:
            save = results[0]["save"] / MIB
            records.append(measurement(FIGURE, f"{spec}: rank 0's model.save", [save], "MiB"))
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=1, width=16384)
    p.add_argument(
        "--layouts",
        nargs="+",
        default=LAYOUTS + CUSTOM_LAYOUTS,
        help='"P,R,T[,zero|zero2|zero3|scope|custom]"',
    )
    p.add_argument("--layout", help="worker: the layout it measures")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layouts = 1024, ["1,1,1", "1,2,1,zero2"]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
