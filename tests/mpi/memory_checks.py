"""Memory scenarios: a rank's measured peak growth next to the memory plan's prediction, and
training under a per-rank memory cap (tests/test_memory_plan.py, tests/test_memory_caps.py).

Arguments: the scenario ("measure" or "capped"), then a layout spec "P,R,T[,zero]" and the
MLP's "WIDTH,DEPTH" (see `wide_mlp`). Every rank reports its measured growth, its plan line
and, when it trained, the final loss.
"""

import sys

import keras
import numpy as np

import hyparflow as hf
from hyparflow.memory.resident import PeakGrowth, resident_bytes
from tests.support.report import args, report, run_or_abort

INPUTS, CLASSES, SAMPLES, BATCH = 256, 10, 128, 32


def wide_mlp(width: int, depth: int, optimizer: str = "adam") -> keras.Model:
    """A weight-heavy MLP: `depth` Dense(width) layers (width² parameters each) on 256
    inputs, so weights and optimizer state dominate and activations are small."""
    keras.utils.set_random_seed(0)
    x = keras.Input((INPUTS,))
    h = x
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(CLASSES)(h), name=f"mlp{width}x{depth}")
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(SAMPLES, INPUTS)).astype("float32"), rng.integers(0, CLASSES, SAMPLES)


def layout(spec: str) -> hf.Strategy:
    """ "P,R,T[,zero]" as the Strategy hf.fit trains with (ZeRO only where Strategy has it)."""
    p, r, t, *flags = spec.split(",")
    kind = "data" if int(p) == 1 else ("model" if int(r) == 1 else "hybrid")
    strategy = hf.Strategy(kind, partitions=int(p), replicas=int(r), tensor=int(t))
    if "zero" in flags:
        import dataclasses

        strategy = dataclasses.replace(strategy, shard_optimizer=True)
    return strategy


def measure(spec: str, shape: str, optimizer: str = "adam") -> dict:
    """Train one epoch and return this rank's peak growth (from before the model is built to
    the epoch's end) beside its line of the memory plan."""
    width, depth = (int(v) for v in shape.split(","))
    strategy = layout(spec)
    x, y = data()
    hf.size()  # MPI and TensorFlow's imports are done before measuring
    base = resident_bytes()
    with PeakGrowth() as growth:
        model = wide_mlp(width, depth, optimizer)
        history = hf.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, strategy=strategy)
    plan = hf.memory_plan(model, strategy, batch_size=BATCH)
    line = plan.ranks[hf.rank()]
    return {
        "spec": spec,
        "growth": growth.bytes,
        "exact_peak": growth.exact,
        "base": base,
        "predicted": line.total,
        "line": line.to_dict(),
        "loss": float(history.history["loss"][-1]),
    }


def main():
    scenario, *rest = args()
    result = {"measure": measure}[scenario](*rest)
    report(result)


if __name__ == "__main__":
    run_or_abort(main)
    sys.exit(0)
