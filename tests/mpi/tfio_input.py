"""hf.fit on a tensorflow-io HDF5 dataset (batched tf.data) on 2 ranks equals Keras on it.

Arguments: FILE (written by tests/test_tfio.py from `tests.support.models.data("mlp")`:
"/x" float32 features, "/y" int64 labels), then strategy kinds to train with ("data", "model").
"""

import keras
import numpy as np
import tensorflow as tf
import tensorflow_io as tfio

import hyparflow as hf
from tests.support.compare import history_difference, relative_difference
from tests.support.models import compiled, data
from tests.support.report import args, report

BATCH, EPOCHS = 16, 2


def hdf5_dataset(path: str) -> tf.data.Dataset:
    """(features, labels) batches read by tensorflow-io's HDF5 ops."""
    x = tfio.IODataset.from_hdf5(path, dataset="/x", spec=tf.float32)
    y = tfio.IODataset.from_hdf5(path, dataset="/y", spec=tf.int64)
    return tf.data.Dataset.zip((x, y)).batch(BATCH)


def known_length(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset with its number of batches declared.

    tensorflow-io's datasets have unknown cardinality, and on those Keras 3.15's `fit` advances
    `optimizer.iterations` once more per epoch than it trains (measured on TF 2.17 and 2.21),
    which shifts Adam's bias correction. The reference declares the length to train exactly.
    """
    batches = -(-len(data("mlp")[0]) // BATCH)
    return dataset.apply(tf.data.experimental.assert_cardinality(batches))


def run(path: str, kind: str) -> dict:
    reference = compiled("mlp", "adam")
    ref = reference.fit(known_length(hdf5_dataset(path)), epochs=EPOCHS, shuffle=False, verbose=0)
    model = compiled("mlp", "adam")
    got = hf.fit(model, hdf5_dataset(path), epochs=EPOCHS, shuffle=False, verbose=0, strategy=kind)
    return {
        "kind": kind,
        "steps": int(model.optimizer.iterations.numpy()),
        "ref_steps": int(reference.optimizer.iterations.numpy()),
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "history": history_difference(got.history, ref.history),
    }


def read_back(path: str) -> bool:
    """Whether tensorflow-io read exactly the arrays the test wrote."""
    x, y = data("mlp")
    batches = list(hdf5_dataset(path).as_numpy_iterator())
    got_x = np.concatenate([b[0] for b in batches])
    got_y = np.concatenate([b[1] for b in batches])
    return bool(np.array_equal(got_x, x) and np.array_equal(got_y, y))


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    path, *kinds = args()
    report(
        {"rank": hf.rank(), "read_back": read_back(path), "results": [run(path, k) for k in kinds]}
    )
