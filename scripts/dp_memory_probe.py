"""Peak resident growth of each rank from before the model is built to the end of one epoch.

Run: python scripts/dp_memory_probe.py              (one process, plain model.fit)
     mpirun -np 2 python scripts/dp_memory_probe.py --strategy data
     mpirun -np 4 python scripts/dp_memory_probe.py --strategy model
Options: --width 4096 --depth 6 (~100 M float32 parameters), --samples 256 --batch 64.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import hyparflow as hf  # noqa: E402
from hyparflow.memory.resident import PeakGrowth  # noqa: E402


def build(width: int, depth: int, inputs: int):
    keras.utils.set_random_seed(0)
    x = inp = keras.Input((inputs,))
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="relu")(x)
    model = keras.Model(inp, keras.layers.Dense(10)(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default=None, help="data, model, hybrid (none: model.fit)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--flat-gradients", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, args.inputs), dtype=np.float32)
    y = rng.integers(0, 10, args.samples)
    with PeakGrowth() as growth:
        model = build(args.width, args.depth, args.inputs)
        if args.strategy is None:
            model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
        else:
            strategy = hf.Strategy(args.strategy, flat_gradients=bool(args.flat_gradients))
            hf.fit(model, x, y, batch_size=args.batch, epochs=1, verbose=0, strategy=strategy)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    params = model.count_params()
    print(json.dumps({"rank": rank, "strategy": args.strategy, "params": params,
                      "W_mib": round(params * 4 / 2**20, 1), "growth_mib": round(growth.mib, 1),
                      "growth_W": round(growth.bytes / (params * 4), 2)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
