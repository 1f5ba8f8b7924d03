"""What exactness on real models costs: global-batch dropout masks and gathered table rows.

Run: .venv/bin/python benchmarks/real_model_costs.py [--rounds 9]
     mpirun -np 2 .venv/bin/python benchmarks/real_model_costs.py --tables

Dropout (one process, one TF thread): the data-parallel compiled step (`FusedRunner`) of an
MLP with two Dropout layers, global batch 256 in 4 micro-batches, each piece taking its rows of
the mask Keras draws for the whole batch (`rows=...`, hyparflow's default) against each piece
drawing its own mask (what hyparflow did before, and what differs from Keras). Prints the
median step of each, interleaved, and their ratio.

Tables (`--tables`, 2 ranks): an embedding table's gradient for a batch of tokens, summed over
the ranks as row slices (`reduce_rows`: gathered, exact) and densified (one `Allreduce` of the
whole table: what hyparflow did before), for a few vocabulary sizes. Prints medians and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

GLOBAL_BATCH, MICROBATCHES, WIDTH = 256, 4, 1024


def _arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternating timed steps")
    parser.add_argument("--tables", action="store_true", help="the 2-rank table reduction")
    return parser.parse_args(argv)


def _dropout_steps(rounds: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    from hyparflow.engine.stages.fused import FusedRunner

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    x = keras.layers.Dropout(0.1)(keras.layers.Dense(WIDTH, activation="relu")(inputs))
    x = keras.layers.Dropout(0.1)(keras.layers.Dense(WIDTH, activation="relu")(x))
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    runner = FusedRunner(
        lambda data, training: model(data, training=training),
        model.trainable_variables,
        loss=lambda y, y_pred, sw: model._compile_loss(y, y_pred, sw),
    )
    rng = np.random.default_rng(0)
    n = GLOBAL_BATCH // MICROBATCHES
    pieces = [
        (tf.constant(rng.normal(size=(n, WIDTH)), tf.float32), tf.constant(rng.integers(0, 10, n)))
        for _ in range(MICROBATCHES)
    ]

    def step(sliced: bool) -> float:
        start = time.perf_counter()
        for k, (data, labels) in enumerate(pieces):
            rows = (k * n, GLOBAL_BATCH) if sliced else None
            runner.forward(k, data, (labels, None), scale=n / GLOBAL_BATCH, rows=rows)
        runner.take_gradients()[0].numpy()
        return time.perf_counter() - start

    for sliced in (True, False, True, False):  # trace and warm both
        step(sliced)
    times = {"global-batch mask, sliced": [], "own mask per piece": []}
    for _ in range(rounds):
        times["global-batch mask, sliced"].append(step(True))
        times["own mask per piece"].append(step(False))
    return {name: statistics.median(values) for name, values in times.items()}


def _table_reductions(rounds: int) -> list:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from hyparflow.engine.gradients.sparse import reduce_rows

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.Get_rank())
    tokens, width = 4096, 256  # tokens per rank
    rows = []
    for vocabulary in (8_192, 32_768, 131_072):
        grad = tf.IndexedSlices(
            tf.constant(rng.normal(size=(tokens, width)), tf.float32),
            tf.constant(rng.integers(0, vocabulary, tokens), tf.int64),
            tf.constant((vocabulary, width), tf.int64),
        )
        times = {"gathered rows": [], "dense allreduce": []}
        for round_ in range(rounds + 2):
            comm.Barrier()
            start = time.perf_counter()
            reduce_rows(comm, [grad])[0].values.numpy()
            gathered = time.perf_counter() - start
            comm.Barrier()
            start = time.perf_counter()
            dense = np.array(tf.convert_to_tensor(grad))
            comm.Allreduce(MPI.IN_PLACE, dense)
            densified = time.perf_counter() - start
            if round_ >= 2:  # warm-up
                times["gathered rows"].append(gathered)
                times["dense allreduce"].append(densified)
        rows.append((vocabulary, {k: statistics.median(v) for k, v in times.items()}))
    return rows


def main(argv=None) -> None:
    args = _arguments(argv)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.tables:
        from mpi4py import MPI

        rows = _table_reductions(args.rounds)
        if MPI.COMM_WORLD.Get_rank() == 0:
            ranks = MPI.COMM_WORLD.Get_size()
            print(f"table gradient of 4096 tokens x 256 per rank, {ranks} ranks")
            for vocabulary, medians in rows:
                ratio = medians["gathered rows"] / medians["dense allreduce"]
                cells = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items())
                print(f"  vocabulary {vocabulary:>7}: {cells}; gathered/dense {ratio:.2f}")
        return
    medians = _dropout_steps(args.rounds)
    for name, seconds in medians.items():
        print(f"{name:28s} {seconds * 1e3:7.2f} ms a step")
    ratio = medians["global-batch mask, sliced"] / medians["own mask per piece"]
    print(
        f"global-batch masks / own masks: {ratio:.3f} (MLP {WIDTH} wide, batch "
        f"{GLOBAL_BATCH} in {MICROBATCHES} micro-batches, 2 Dropout layers)"
    )


if __name__ == "__main__":
    main()
