"""Deep models plan without recursion on depth; balance="time" measures stage times."""

import inspect
import sys

import keras
import numpy as np
import pytest
from keras import layers

from hyparflow.partitioner import partition
from tests.support.partitioner import check_outputs


def deep_chain(depth, width=4):
    x = keras.Input((width,))
    h = x
    for i in range(depth):
        h = layers.Dense(width, activation="tanh")(h)
        if i % 10 == 9:  # a skip every ten layers
            h = layers.Add()([h, x])
    return keras.Model(x, h)


@pytest.fixture(scope="module")
def deep_model():
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, 20000))  # Keras's own graph walk recurses on depth
    try:
        yield deep_chain(500)
    finally:
        sys.setrecursionlimit(previous)


def test_planning_a_deep_model_does_not_recurse_on_depth(deep_model):
    """With 550 layer calls in 8 stages, Keras builds each stage model recursing ~70 deep; a
    partitioner walking the whole graph recursively would need 550 frames and fail here."""
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 400)
    try:
        for balance in ("layers", "flops"):
            plan = partition(deep_model, 8, balance=balance, bandwidth=1e6)
    finally:
        sys.setrecursionlimit(previous)
    assert sum(len(s.nodes) for s in plan.stages) == 550
    sys.setrecursionlimit(max(previous, 20000))
    try:
        check_outputs(deep_model, plan, np.ones((2, 4), "float32"))
    finally:
        sys.setrecursionlimit(previous)


def test_time_balance_measures_every_stage():
    x = keras.Input((16, 16, 3))
    h = x
    for filters in (8, 8, 16, 16, 32):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = layers.BatchNormalization()(h)
    model = keras.Model(x, layers.Dense(4)(layers.GlobalAveragePooling2D()(h)))
    bn_mean = model.layers[2].moving_mean.numpy().copy()
    plan = partition(model, 3, balance="time", batch_size=4)
    assert all(s.measured_time and s.measured_time > 0 for s in plan.stages)
    assert all(s.cost > 0 for s in plan.stages)
    assert plan.measured_imbalance >= 1.0 and plan.batch_size == 4
    assert "measured (ms)" in plan.summary(print_fn=None)
    # profiling ran BatchNormalization in training mode but left its statistics unchanged
    np.testing.assert_array_equal(model.layers[2].moving_mean.numpy(), bn_mean)
    sample = np.zeros((2, 16, 16, 3), "float32")
    plan.profile(sample=sample, repeats=2)
    check_outputs(model, plan, sample)


def test_time_balance_needs_known_input_shapes():
    x = keras.Input((None, 3))
    model = keras.Model(x, layers.Dense(2)(layers.Dense(3)(x)))
    with pytest.raises(ValueError, match="input_shape="):
        partition(model, 2, balance="time")
    plan = partition(model, 2, balance="time", input_shape=(5, 3), batch_size=2)
    assert len(plan.stages) == 2
