"""Row-sparse gradients of both kinds, in one process: rows looked up with the batch's own
indices (pieces concatenate) and rows looked up once per batch (broadcast indices: pieces add),
as `engine/keras_semantics/sparse_probe.py` classifies them and `engine/gradients/sparse.py`
combines them."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hyparflow.engine.gradients import sparse as row_sparse
from hyparflow.engine.keras_semantics.sparse_probe import probe_row_kinds
from tests.support import zoo


def _paths(model, ids) -> set:
    return {v.path for v in model.trainable_variables if id(v) in ids}


def _row_gradients(model, x) -> dict:
    """Each row-sparse variable's gradient of the summed outputs on `x`, by path."""
    sources = [v.value for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(model(x, training=False))
    grads = tape.gradient(total, sources)
    return {
        v.path: g
        for v, g in zip(model.trainable_variables, grads, strict=True)
        if isinstance(g, tf.IndexedSlices)
    }


@pytest.fixture(scope="module")
def model():
    return zoo.compiled("broadcast_tables", "adam")


def test_broadcast_lookups_and_gathered_variables_are_rows_per_batch(model):
    kinds = probe_row_kinds(model, zoo.data("broadcast_tables")[0])
    assert kinds.complete
    assert _paths(model, kinds.per_sample) == {"token_table/embeddings"}
    assert _paths(model, kinds.per_batch) == {
        "broadcast_positions/position_table/embeddings",
        "relative_mixing/relative_bias",
    }


def test_pieces_combine_into_the_whole_batchs_row_slices(model):
    """Halves of a batch, combined by kind, give the very pairs of the whole batch: a
    broadcast table's rows added (concatenated, each pair would appear twice, half-valued)."""
    x = zoo.data("broadcast_tables", n=8)[0]
    kinds = probe_row_kinds(model, x)
    whole = _row_gradients(model, x)
    halves = [_row_gradients(model, x[:4]), _row_gradients(model, x[4:])]
    for v in model.trainable_variables:
        if v.path not in whole:
            continue
        combined = row_sparse.concat_rows([h[v.path] for h in halves], v, kinds.is_per_batch(v))
        np.testing.assert_array_equal(combined.indices.numpy(), whole[v.path].indices.numpy())
        np.testing.assert_allclose(
            combined.values.numpy(), whole[v.path].values.numpy(), rtol=1e-5, atol=1e-6
        )
    table = "broadcast_positions/position_table/embeddings"
    concatenated = row_sparse.concat_rows(
        [h[table] for h in halves], model.get_layer("broadcast_positions").table.embeddings
    )
    assert len(concatenated.indices) == 2 * len(whole[table].indices)


def test_rows_of_pieces_that_differ_are_refused():
    pieces = [
        tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 1], tf.int64), tf.constant([4, 3])),
        tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 2], tf.int64), tf.constant([4, 3])),
    ]
    with pytest.raises(ValueError, match="looked up once per batch"):
        row_sparse.add_rows(pieces, (4, 3), "t")


def test_a_table_looked_up_both_ways_is_refused_up_front():
    tokens = keras.Input((zoo.LENGTH,), dtype="int32")
    table = keras.layers.Embedding(zoo.VOCAB, 4)
    x = zoo.BroadcastPositions(zoo.LENGTH, 4)(table(tokens))
    both = SharedLookup(table)(x)
    model = keras.Model(tokens, keras.layers.Dense(2)(keras.layers.Flatten()(both)))
    with pytest.raises(ValueError, match="both with the batch's own indices"):
        probe_row_kinds(model, np.zeros((3, zoo.LENGTH), "int32"))


class SharedLookup(keras.layers.Layer):
    """Adds rows of another layer's table looked up by position (broadcast over the batch)."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return x + self.table(keras.ops.arange(keras.ops.shape(x)[1])[None, :])
