"""ResNet50 split with balance="time": measured slowest stage over mean stage time.

Run: .venv/bin/python benchmarks/resnet50_time_balance.py [--partitions 4] [--batch-size 32]
     [--image-size 32]

Prints the plan table, whose last lines give the estimated and measured imbalance.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import keras

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from hyparflow.partitioner import partition  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args(argv)

    shape = (args.image_size, args.image_size, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=10)
    for balance in ("flops", "time"):
        start = time.perf_counter()
        plan = partition(model, args.partitions, balance=balance, batch_size=args.batch_size)
        planning = time.perf_counter() - start
        if balance != "time":
            plan.profile(batch_size=args.batch_size)
        plan.summary()
        print(f"(planning took {planning:.1f} s)\n")


if __name__ == "__main__":
    main()
