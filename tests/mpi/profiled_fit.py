"""hf.fit with a ScalingProfiler under mpirun; the test reads back what it wrote.

Arguments: a log root folder, then cases as JSON (tests/support/cases.py). Each trains a
four-layer MLP whose two halves cost the same (WIDTHS: the case's model), or for tensor
parallelism two Dense pairs ("dense_pairs"), or for expert parallelism keras_hub's tiny
Mixtral ("mixtral", tests/support/zoo.py), and profiles it into `<log root>/<case id>`.
"""

import os

import keras
import numpy as np

import hyparflow as hf
from hyparflow.callbacks import ScalingProfiler
from hyparflow.comm.in_graph import traffic
from hyparflow.moe import expert_parallel
from hyparflow.tensor import collectives
from tests.support import zoo
from tests.support.cases import Case
from tests.support.report import args, report

FEATURES, CLASSES = 16, 8
BATCH, SAMPLES, EPOCHS = 512, 512 * 4, 2
BASELINE = 1000.0  # samples/s of "one rank": any positive number, the test checks the ratio
WIDTHS = {"equal_stages_wide": 1024, "equal_stages": 64}


def equal_stages_mlp(width: int):
    """Split 2-way by layer count, each stage has one width x width matmul forward and two
    backward (the first stage's needs no input gradient, but its first layer is narrow, as is
    the second stage's classifier), so the stages cost the same."""
    inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(width, activation="relu")(inputs)
    x = keras.layers.Dense(width, activation="relu")(x)
    x = keras.layers.Dense(width, activation="relu")(x)
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def dense_pairs_mlp():
    """Two Dense pairs, widening then narrowing: tensor parallelism splits each into a column
    and a row layer, so every forward and backward runs tensor collectives."""
    inputs = keras.Input((FEATURES,))
    x = inputs
    for _ in range(2):
        x = keras.layers.Dense(16, activation="relu")(x)
        x = keras.layers.Dense(CLASSES)(x)
    model = keras.Model(inputs, x)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="sgd", loss=loss)
    return model


def run(log_root: str, case: Case) -> dict:
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=SAMPLES)
    batch_size = BATCH
    if case.model == "dense_pairs":
        model = dense_pairs_mlp()
    elif case.model == "mixtral":  # 4 batches of tokens, as the MLPs have
        model = zoo.compiled("mixtral", case.optimizer)
        x, y, batch_size = zoo.text_batches("mixtral", 16).take(4), None, None
    else:
        model = equal_stages_mlp(WIDTHS[case.model])
    strategy = hf.Strategy(**case.strategy_options())
    log_dir = os.path.join(log_root, case.id)
    profiler = ScalingProfiler(log_dir, baseline_throughput=BASELINE, profile_steps=(2, 3))
    hf.fit(
        model,
        x,
        y,
        batch_size=batch_size,
        epochs=EPOCHS,
        verbose=0,
        strategy=strategy,
        callbacks=[profiler],
    )
    trainer = model._hyparflow_trainer[1]
    return {
        "case": case.id,
        "log_dir": log_dir,
        "stage": trainer.topology.stage,
        "replica": trainer.topology.replica,
        "detached": trainer.recorder is None,  # profiling off again after fit
        "listener_cleared": all(
            traffic(tag).listener is None for tag in (collectives.TAG, *expert_parallel.SPAN_TAGS)
        ),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    log_root, *cases = args()
    report({"rank": hf.rank(), "results": [run(log_root, Case.from_json(c)) for c in cases]})
