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
model with its own `train_step`, the Keras guide's, which each replica runs), "subclassed"
(the same layers in a subclassed model: no layer graph, which ZeRO-3 gathers layer by layer).

`--model transformer`: a 102.4 M-parameter transformer encoder instead (64 token ids,
Embedding(2048, 768) and a learned position embedding, 14 pre-norm blocks of 12-head attention
and a GELU 3072 feed-forward, a final LayerNormalization and Dense(2048) logits per position;
Adam, sparse cross-entropy from logits, batch 4, 2 steps): many layers, as people train, and a
batch small enough that one process's peak is its weights, gradients and Adam state (at batch
16 activations were 39% of it). `--batch-size B`: B rows a step instead (over all replicas).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import run_worker, write_result  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402
from benchmarks.models import encoder_block  # noqa: E402

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
SUBCLASSED_LAYOUTS = ["1,1,1,subclassed", "1,4,1,zero3,subclassed,scope"]
# --model transformer: sequence length, vocabulary, width, heads, blocks, batch (2 steps)
LENGTH, VOCAB, WIDTH, HEADS, DEPTH, BATCH = 64, 2048, 768, 12, 14, 4
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


def _model(width: int, scope: bool, custom: bool = False, subclassed: bool = False):
    import contextlib

    import keras

    import hyparflow as hf

    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.Adam(1e-4)  # before the scope (docs/big_models.md)
    kind = _own_step_model() if custom else keras.Model
    with hf.scope() if scope else contextlib.nullcontext():
        inputs = keras.Input((1024,))
        if subclassed:
            model = _subclassed_mlp(width)
            model(inputs)
        else:
            h = inputs
            for _ in range(3):
                h = keras.layers.Dense(width, activation="relu")(h)
                h = keras.layers.Dense(1024)(h)
            model = kind(inputs, h, name=f"mlp_3x{width}")
        model.compile(optimizer, "mse")
    return model


def _subclassed_mlp(width: int):
    """`_model`'s layers in a subclassed model (no layer graph)."""
    import keras

    class MLP(keras.Model):
        def __init__(self):
            super().__init__(name=f"subclassed_mlp_3x{width}")
            self.pairs = [
                (keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1024))
                for _ in range(3)
            ]

        def call(self, x):
            for widen, narrow in self.pairs:
                x = narrow(widen(x))
            return x

    return MLP()


def _transformer(scope: bool, custom: bool = False):
    """The `--model transformer` encoder (the docstring's), built as `_model` builds the MLP."""
    import contextlib

    import keras
    import keras_hub

    import hyparflow as hf

    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.Adam(1e-4)  # before the scope (docs/big_models.md)
    kind = _own_step_model() if custom else keras.Model
    with hf.scope() if scope else contextlib.nullcontext():
        tokens = keras.Input((LENGTH,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, WIDTH, name="tokens")(tokens)
        positions = keras_hub.layers.PositionEmbedding(LENGTH, name="positions")(x)
        x = keras.layers.Add(name="embedded")([x, positions])
        for i in range(DEPTH):
            x = encoder_block(x, i, WIDTH, HEADS)
        x = keras.layers.LayerNormalization(name="norm_out")(x)
        logits = keras.layers.Dense(VOCAB, name="logits")(x)
        model = kind(tokens, logits, name=f"transformer_{DEPTH}x{WIDTH}")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer, loss)
    return model


def _build(args, flags: list):
    """The measured model, its inputs, targets and batch size (2 steps either way)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if args.model == "transformer":
        batch = args.batch_size or BATCH
        x = rng.integers(0, VOCAB, size=(2 * batch, LENGTH), dtype=np.int32)
        y = rng.integers(0, VOCAB, size=(2 * batch, LENGTH), dtype=np.int32)
        return _transformer("scope" in flags, "custom" in flags), x, y, batch
    batch = args.batch_size or 32
    x = rng.normal(size=(2 * batch, 1024)).astype("float32")
    y = rng.normal(size=(2 * batch, 1024)).astype("float32")
    kinds = ("scope" in flags, "custom" in flags, "subclassed" in flags)
    return _model(args.width, *kinds), x, y, batch


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

    import tensorflow as tf

    import hyparflow as hf
    from hyparflow.memory.resident import PeakGrowth

    hf.size()  # MPI and TensorFlow imported before measuring
    flags = args.layout.split(",")
    scope = "scope" in flags
    tf.config.experimental.reset_memory_stats("CPU:0")
    with PeakGrowth() as growth:
        steps = _steps_peak(growth.start)
        model, x, y, batch_size = _build(args, flags)
        parameters = sum(math.prod(v.shape) for v in model.weights)  # before any slicing
        strategy = _strategy(args.layout) if hf.size() > 1 else "data"
        hf.fit(
            model,
            x,
            y,
            batch_size=batch_size,
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
            "parameters": parameters,
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
        worker_args = [*cli.flags(args, "width", "batch_size", "model"), "--layout", spec]
        results = run_worker(__file__, worker_args, np=ranks, env=POOLED)
        label = spec if args.model == "mlp" else f"transformer {spec}"  # mlp: today's names
        if args.model != "mlp" and not records:
            count = results[0]["parameters"] / 1e6
            records.append(measurement(FIGURE, "transformer parameters", [count], "M"))
        largest = max(r["growth"] for r in results) / MIB
        training = max(r["training"] for r in results) / MIB
        allocated = max(r["allocated"] for r in results) / MIB
        if math.prod(int(n) for n in spec.split(",")[:3]) == 1:  # one process (custom too)
            alone, alone_training, alone_allocated = largest, training, allocated
        records.append(measurement(FIGURE, f"{label}: largest rank's growth", [largest], "MiB"))
        name = f"{label}: largest rank's training"
        records.append(measurement(FIGURE, name, [training], "MiB"))
        name = f"{label}: largest rank's training, allocated"
        records.append(measurement(FIGURE, name, [allocated], "MiB"))
        if alone is not None and ranks > 1:
            ratio = largest / alone
            records.append(measurement(FIGURE, f"{label}: / one process", [ratio], "ratio"))
            ratio = training / alone_training
            name = f"{label}: training / one process"
            records.append(measurement(FIGURE, name, [ratio], "ratio"))
            ratio = allocated / alone_allocated
            name = f"{label}: training, allocated / one process"
            records.append(measurement(FIGURE, name, [ratio], "ratio"))
        if results[0]["save"] is not None:
            save = results[0]["save"] / MIB
            records.append(measurement(FIGURE, f"{label}: rank 0's model.save", [save], "MiB"))
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=1, width=16384, batch_size=0)
    p.add_argument(
        "--layouts",
        nargs="+",
        default=LAYOUTS + CUSTOM_LAYOUTS + SUBCLASSED_LAYOUTS,
        help='"P,R,T[,zero|zero2|zero3|scope|custom|subclassed]"',
    )
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--layout", help="worker: the layout it measures")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layouts = 1024, ["1,1,1", "1,2,1,zero2"]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
