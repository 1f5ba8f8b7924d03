"""Issue 66: `hyparflow plan --auto`'s own time and peak memory against the model's size.

Run: .venv/bin/python benchmarks/planning_cost.py [--quick] [--sizes 10M 100M 1B 10B]

Transformers of plain Keras layers (an embedding of 8,000 tokens, blocks of LayerNormalization,
MultiHeadAttention, Dense 4w and Dense w, a vocabulary head), sequences of 128 tokens, Adam,
built under `hf.scope()` (`module:function`), at about 10 M, 100 M, 1 B and 10 B parameters.
Each is planned by a fresh `hyparflow plan --auto` for 64 ranks on 8 nodes of 8 cores, batch
64, 16 GiB per rank, a given network (2 us, 12 GB/s: no probe): the wall time of the command
and its peak resident memory (`wait4`'s `ru_maxrss`), each layer timed alone on this machine's
cores, the pick in the record's parameters. One run per size: planning is minutes at 10 B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from benchmarks.harness import cli  # noqa: E402
from benchmarks.harness.launch import REPO, python_for  # noqa: E402
from benchmarks.harness.records import measurement  # noqa: E402

FIGURE = "planning"
TITLE = "plan --auto: planning time and peak memory against parameters (hf.scope() transformers)"
VOCAB, LENGTH = 8000, 128
SIZES = {"10M": (256, 8), "100M": (768, 12), "1B": (2048, 20), "10B": (5120, 32)}  # width, blocks
PLAN = [
    "--ranks", "64", "--nodes", "8", "--cores-per-node", "8", "--batch", "64",
    "--memory", "16GiB", "--latency", "2e-6", "--bandwidth", "12e9", "--json",
]  # fmt: skip


worker = None  # no MPI worker: each size is planned by a `hyparflow plan --auto` process


def scoped_transformer():
    """The transformer of `PLANNING_WIDTH` and `PLANNING_BLOCKS` (environment), under hf.scope()."""
    import keras

    import hyparflow as hf

    width, blocks = int(os.environ["PLANNING_WIDTH"]), int(os.environ["PLANNING_BLOCKS"])
    with hf.scope():
        tokens = keras.Input((LENGTH,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, width)(tokens)
        for _ in range(blocks):
            h = keras.layers.LayerNormalization()(x)
            h = keras.layers.MultiHeadAttention(width // 128, 128)(h, h, use_causal_mask=True)
            x = keras.layers.Add()([x, h])
            h = keras.layers.LayerNormalization()(x)
            h = keras.layers.Dense(4 * width, activation="gelu")(h)
            x = keras.layers.Add()([x, keras.layers.Dense(width)(h)])
        model = keras.Model(tokens, keras.layers.Dense(VOCAB)(x), name=f"transformer_{width}")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.Adam(1e-4), loss)
    return model


def parameters(width: int, blocks: int) -> int:
    """The transformer's parameter count (its weights' and biases' sizes)."""
    block = 4 * (width * width + width) + 2 * (width * 4 * width) + 5 * width + 4 * width
    return VOCAB * width + blocks * block + width * VOCAB + VOCAB


def planned(width: int, blocks: int) -> tuple[float, int, dict]:
    """Seconds, peak resident bytes and the JSON of one `plan --auto` of the transformer."""
    command = [python_for("main"), "-m", "hyparflow.cli", "plan", "--auto"]
    command += ["benchmarks.planning_cost:scoped_transformer", *PLAN]
    env = {
        **os.environ,
        "PLANNING_WIDTH": str(width),
        "PLANNING_BLOCKS": str(blocks),
        "PYTHONPATH": str(REPO),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {status})")
    return seconds, usage.ru_maxrss * 1024, json.loads(out)


def run(args) -> list[dict]:
    records = []
    for name in args.sizes:
        width, blocks = SIZES[name]
        seconds, peak, found = planned(width, blocks)
        millions = parameters(width, blocks) / 1e6
        pick = {"pick": found["pick"]["label"], "bytes": found["pick"]["memory_per_rank_bytes"]}
        for value, unit, series in ((seconds, "s", "seconds"), (peak / 2**30, "GiB", "peak")):
            records.append(
                measurement(
                    FIGURE,
                    f"{name}: {series}",
                    [value],
                    unit,
                    series=series,
                    x=millions,
                    x_label="parameters (millions)",
                    **pick,
                )
            )
    return records


def arguments(argv=None):
    p = cli.parser(__doc__, repeats=1)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = ["10M", "100M"]
    return args


if __name__ == "__main__":
    cli.entry(arguments(), worker, run)
