"""`hf.global_mean` and the strict mode for added losses, in one process (the replicas'
runs against Keras are in tests/test_real_models.py, the refusals under mpirun in
tests/test_misuse.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hyparflow as hf
from hyparflow.engine.keras_semantics.added_losses import refuse_unless_batch_means
from hyparflow.engine.keras_semantics.global_batch import BatchGroup, batch_group
from tests.support import zoo


def _rows():
    return tf.constant(np.random.default_rng(0).normal(size=(5, 3)), tf.float32)


def test_outside_the_engine_it_is_the_plain_mean():
    rows = _rows()
    np.testing.assert_allclose(hf.global_mean(rows), keras.ops.mean(rows, axis=0), rtol=1e-6)
    np.testing.assert_allclose(hf.global_mean(rows, axis=1), keras.ops.mean(rows, axis=1))


def test_over_one_replica_it_is_the_mean_with_its_gradient():
    rows = _rows()
    for comm in (None, MPI.COMM_SELF):
        with batch_group(BatchGroup(comm, microbatches=1)), tf.GradientTape() as tape:
            tape.watch(rows)
            loss = tf.reduce_sum(tf.square(hf.global_mean(rows)))
        got = tape.gradient(loss, rows)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            expected = tape.gradient(tf.reduce_sum(tf.square(tf.reduce_mean(rows, 0))), rows)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_the_layers_that_take_it_are_noted_and_micro_batches_refused():
    group = BatchGroup(MPI.COMM_SELF, microbatches=1)
    model = zoo.global_centered()
    with batch_group(group):
        model(np.zeros((4, 6), "float32"))
    assert group.users == {"global_centering"}
    refused = pytest.raises(ValueError, match="use num_microbatches=1")
    with batch_group(BatchGroup(None, microbatches=2)), refused:
        model(np.zeros((4, 6), "float32"))


def test_strict_mode_refuses_added_losses_of_a_batch_in_pieces():
    refuse_unless_batch_means(set(), 4, MPI.COMM_SELF)  # no adders: nothing to refuse
    refuse_unless_batch_means({"penalty"}, 1, MPI.COMM_SELF)  # one piece: exact
    with pytest.raises(ValueError, match=r"\['penalty'\].*strict_added_losses=True"):
        refuse_unless_batch_means({"penalty"}, 2, MPI.COMM_SELF)
    with pytest.raises(ValueError, match="must be True or False"):
        hf.Strategy("data", strict_added_losses="yes")
