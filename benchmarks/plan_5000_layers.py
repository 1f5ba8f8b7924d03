"""Time `hyparflow.partition` on a 5,000-layer model (HyPar-Flow's largest).

Run: .venv/bin/python benchmarks/plan_5000_layers.py [--layers 5000] [--partitions 4 16 64]

Building the Keras model itself needs a raised recursion limit (Keras walks its graph
recursively); the partitioner does not recurse on depth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import keras
from keras import layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from hyparflow.partitioner import partition  # noqa: E402


def build(num_layers: int, width: int = 8):
    """A chain of Dense layers with a residual Add every 10 layers (a skip to the input)."""
    x = keras.Input((width,))
    h = x
    count = 0
    while count < num_layers:
        h = layers.Dense(width, activation="relu")(h)
        count += 1
        if count % 10 == 0 and count < num_layers:
            h = layers.Add()([h, x])
            count += 1
    return keras.Model(x, h)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5000)
    parser.add_argument("--partitions", type=int, nargs="+", default=[4, 16, 64])
    args = parser.parse_args(argv)

    sys.setrecursionlimit(100_000)  # for Keras's own graph construction
    start = time.perf_counter()
    model = build(args.layers)
    print(f"built {len(model.layers) - 1}-layer model in {time.perf_counter() - start:.1f} s")

    for balance, bandwidth in (("layers", None), ("flops", None), ("flops", 1e9)):
        for k in args.partitions:
            start = time.perf_counter()
            plan = partition(model, k, balance=balance, bandwidth=bandwidth)
            seconds = time.perf_counter() - start
            label = balance + (" + bandwidth" if bandwidth else "")
            print(
                f"partition(model, {k:3d}, balance={label!r:22}) {seconds:6.2f} s   "
                f"estimated imbalance {plan.estimated_imbalance:.3f}"
            )


if __name__ == "__main__":
    main()
