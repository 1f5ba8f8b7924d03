"""Property tests: random DAGs of Dense/Add/Concatenate with skips, split at random."""

import keras
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from keras import layers

from hyparflow.partitioner import partition
from tests.support.partitioner import check_plan


@st.composite
def dag_recipes(draw):
    """A DAG as data: input widths, then steps ("dense", width, source, reuse?),
    ("add" | "concat", sources), and which tensors are outputs. Sources are indices of
    earlier tensors, so any step may read a tensor from far back (a skip edge)."""
    input_widths = draw(st.lists(st.integers(2, 4), min_size=1, max_size=2))
    steps = []
    count = len(input_widths)
    for _ in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["dense", "dense", "add", "concat"]))
        if kind == "dense":
            source = draw(st.integers(0, count - 1))
            steps.append(("dense", draw(st.integers(2, 4)), source, draw(st.booleans())))
        else:
            sources = draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=3))
            steps.append((kind, sources))
        count += 1
    extra = draw(st.lists(st.integers(len(input_widths), count - 1), max_size=2))
    return input_widths, steps, extra


def build_model(recipe):
    """The Keras model of a recipe; Dense layers are reused (tied) when asked and possible,
    an Add of tensors of different widths becomes a Concatenate."""
    input_widths, steps, extra = recipe
    inputs = [keras.Input((w,)) for w in input_widths]
    tensors = list(inputs)
    dense_layers = []  # (layer, input width)
    for step in steps:
        if step[0] == "dense":
            _, width, source, reuse = step
            source = tensors[source]
            reusable = [layer for layer, w in dense_layers if w == source.shape[-1]]
            if reuse and reusable:
                layer = reusable[len(tensors) % len(reusable)]
            else:
                layer = layers.Dense(width, activation="tanh")
                dense_layers.append((layer, source.shape[-1]))
            tensors.append(layer(source))
            continue
        kind, sources = step
        chosen = [tensors[i] for i in sources]
        if kind == "add" and len({t.shape[-1] for t in chosen}) == 1:
            tensors.append(layers.Add()(chosen))
        else:
            tensors.append(layers.Concatenate()(chosen))
    last = layers.Dense(2)(tensors[-1])  # every model has weights to differentiate
    outputs = list(dict.fromkeys([last, *(tensors[i] for i in extra)]))
    model = keras.Model(
        inputs if len(inputs) > 1 else inputs[0], outputs if len(outputs) > 1 else outputs[0]
    )
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((3, w)).astype("float32") for w in input_widths]
    return model, (x if len(x) > 1 else x[0])


@settings(max_examples=15, deadline=None)
@given(recipe=dag_recipes(), data=st.data())
def test_random_dag_split_is_exact(recipe, data):
    model, x = build_model(recipe)
    num_calls = len(partition(model, 1).stages[0].nodes)
    num_partitions = data.draw(st.integers(1, min(5, num_calls)), label="num_partitions")
    balance = data.draw(st.sampled_from(["layers", "params", "flops"]), label="balance")
    plan = partition(model, num_partitions, balance=balance)
    check_plan(model, plan, x, num_partitions)
