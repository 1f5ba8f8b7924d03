"""A batch's loss computed in pieces leaves Keras's per-output loss means where Keras's own
compiled or eager `evaluate` of the whole batches leaves them
(engine/keras_semantics/output_losses.py)."""

import pytest
import tensorflow as tf

from hyparflow import _keras
from hyparflow.engine.keras_semantics.output_losses import OutputLosses
from tests.support.models import compiled, data


def _in_pieces(model, x, y, losses) -> dict:
    """Batches of 16 and 12 rows, each cut into two unequal pieces, through `losses`."""
    traced = tf.function(losses)  # traced once per piece size, as the engine runs it
    for start, size in ((0, 16), (16, 12)):
        losses.begin(size)
        middle = start + size // 2 + 1
        for cut in (slice(start, middle), slice(middle, start + size)):
            y_pred = model({k: v[cut] for k, v in x.items()}, training=False)
            traced({k: tf.constant(v[cut]) for k, v in y.items()}, y_pred, None)
    return {m.name: float(m.result()) for m in _keras.compiled_loss(model).metrics}


def test_pieces_weigh_as_compiled_and_eager_keras_weigh_their_batch():
    x, y = data("multi_io", n=28)
    expected = {}
    for eager in (False, True):
        model = compiled("multi_io", "sgd")
        model.run_eagerly = eager
        expected[eager] = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        model.reset_metrics()
        got = _in_pieces(model, x, y, OutputLosses(model))
        assert sorted(got) == ["classes_loss", "regression_loss"]
        for name, value in got.items():
            assert value == pytest.approx(expected[eager][name], rel=1e-6), (eager, name)
    # compiled Keras counts the last batch once, eager Keras by its rows: they differ here
    assert expected[False]["regression_loss"] != pytest.approx(expected[True]["regression_loss"])


def test_first_call_weighs_the_means_it_builds_and_leaves_keras_as_it_was():
    x, y = data("multi_io", n=12)
    model = compiled("multi_io", "sgd")
    losses = OutputLosses(model)
    losses.begin(12)
    y_pred = model({k: v[:6] for k, v in x.items()}, training=False)
    losses({k: tf.constant(v[:6]) for k, v in y.items()}, y_pred, None)  # builds the Means
    means = list(_keras.compiled_loss(model).metrics)
    assert [float(m.count.numpy()) for m in means] == [0.5, 0.5]  # half of the batch
    assert "build" not in vars(_keras.compiled_loss(model))
    assert all("update_state" not in vars(m) for m in means)
    model.evaluate(x, y, batch_size=8, verbose=0)  # Keras's own weighting: 2 batches, 1 each
    assert [float(m.count.numpy()) for m in means] == [2.0, 2.0]
