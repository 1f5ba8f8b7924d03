"""A model whose outputs for a sample depend on the other samples of its batch is refused where
the batch is cut into pieces (engine/keras_semantics/batch_coupling.py,
model_checks.check_sample_coupling)."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow.engine.keras_semantics.batch_coupling import sample_coupling
from hyparflow.model_checks import check_sample_coupling


@keras.saving.register_keras_serializable(package="test_batch_coupling")
class BatchCentering(keras.layers.Layer):
    """Subtracts the batch's mean in inference too: each sample sees the others."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


def _model(mixing: bool) -> keras.Model:
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4)(inputs)
    x = BatchCentering()(x) if mixing else keras.layers.LayerNormalization()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


X = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")


def test_a_model_that_mixes_samples_is_refused_when_the_batch_is_cut():
    model = _model(mixing=True)
    assert sample_coupling(model, X) > 1e-2
    cut = [
        hf.Strategy("data", replicas=2, microbatches=1),
        hf.Strategy("model", partitions=2, replicas=1, microbatches=2),
    ]
    for strategy in cut:
        with pytest.raises(ValueError, match="mixes the samples of a batch"):
            check_sample_coupling(model, strategy, X)
    # whole batches on every rank: a pipeline of one micro-batch, tensor ranks
    check_sample_coupling(model, hf.Strategy("model", partitions=2, replicas=1, microbatches=1), X)


def test_a_model_of_independent_samples_passes():
    model = _model(mixing=False)
    assert sample_coupling(model, X) < 1e-6
    check_sample_coupling(model, hf.Strategy("data", replicas=2, microbatches=1), X)


def test_without_arrays_of_two_samples_nothing_is_run():
    assert sample_coupling(_model(mixing=True), None) is None
    assert sample_coupling(_model(mixing=True), X[:1]) is None


@keras.saving.register_keras_serializable(package="test_batch_coupling")
class GlobalMeanCentering(keras.layers.Layer):
    """Centres on `hf.global_mean`: coupled on purpose, and exact under replicas."""

    def call(self, x):
        return x - hf.global_mean(x)


def test_a_model_taking_hf_global_mean_is_not_refused():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(GlobalMeanCentering()(inputs)))
    assert sample_coupling(model, X) is None
    check_sample_coupling(model, hf.Strategy("data", replicas=2, microbatches=1), X)
