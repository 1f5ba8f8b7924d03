"""TensorFlow's CPU allocator peak of one fused data-parallel step, measured in a fresh process.

Run as `TF_CPU_ALLOCATOR_USE_BFC=true python -m tests.support.allocator_peak`: prints JSON
{"bucketed", "whole", "gradient_bytes", "bucket_bytes"}. TensorFlow's default CPU allocator keeps no
statistics unless oneDNN is on (TensorFlow turns it on for CPUs with AVX-512 VNNI or newer); the BFC
allocator keeps them on any CPU, and its peak counts live bytes. A process of its own, because in a
long pytest process what earlier tests left in TensorFlow's allocator and threads moves the peak (a
full `make test` measured 1.43x where the same test alone measures 1.25x).
"""

import json

import keras
import tensorflow as tf

from hyparflow.engine.gradients import flat
from hyparflow.engine.stages.fused import FusedRunner


def allocator_peak_of_one_step(layout) -> tuple[int, int]:
    """TensorFlow's CPU allocator bytes above the live ones at the start of a fused step of a
    weight-heavy MLP (~32 MiB of float32 parameters), and its gradient bytes."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1024,))
    x = inputs
    for _ in range(8):
        x = keras.layers.Dense(1024, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(loss="mse", optimizer="sgd")
    runner = FusedRunner(
        lambda i, training: model(i, training=training),
        model.trainable_variables,
        loss=lambda yt, yp, sw: model._compile_loss(yt, yp, sw),
        layout=layout(model),
    )
    data = tf.ones((16, 1024)), (tf.ones((16, 10)), None)
    runner.forward(0, data[0], data[1])  # traced once, before measuring
    runner.take_flat_gradients()
    tf.config.experimental.reset_memory_stats("CPU:0")
    live = tf.config.experimental.get_memory_info("CPU:0")["current"]
    runner.forward(0, data[0], data[1])
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - live
    return peak, 4 * model.count_params()


BUCKET_BYTES = 4 * 2**20

if __name__ == "__main__":
    bucketed, gradient_bytes = allocator_peak_of_one_step(
        lambda m: flat.BucketedLayout(m.trainable_variables, bucket_bytes=BUCKET_BYTES)
    )
    whole, _ = allocator_peak_of_one_step(lambda m: flat.FlatLayout(m.trainable_variables))
    peaks = {"bucketed": bucketed, "whole": whole, "gradient_bytes": gradient_bytes}
    print(json.dumps({**peaks, "bucket_bytes": BUCKET_BYTES}))
