"""Partitioner on every graph kind: the stage chain reproduces outputs and gradients exactly."""

import json

import keras
import numpy as np
import pytest
from keras import layers

from hyparflow.partitioner import BoundaryTensor, Plan, Stage, partition
from tests.support.partitioner import check_plan, leaf_layer_names

RNG = np.random.default_rng(0)
PARTITIONS = [1, 2, 3, 4]


def rand(*shape):
    return RNG.standard_normal(shape).astype("float32")


def sequential_with_input():
    return keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(8, activation="relu"),
            layers.Dense(8),
            layers.Dense(5),
            layers.Dense(3),
        ]
    )


def sequential_with_input_shape():
    with pytest.warns(UserWarning):  # Keras prefers keras.Input, but supports this
        first = layers.Dense(8, activation="tanh", input_shape=(6,))
    return keras.Sequential([first, layers.Dense(5), layers.Dense(4), layers.Dense(3)])


def sequential_built_by_calling():
    model = keras.Sequential([layers.Dense(8), layers.Dense(5), layers.Dense(4), layers.Dense(3)])
    model(rand(2, 6))
    return model


def sequential_built_by_build():
    model = keras.Sequential([layers.Dense(8), layers.Dense(5), layers.Dense(4), layers.Dense(3)])
    model.build((None, 6))
    return model


def skip_connections():
    """A U-Net-like chain: early tensors are read many layers (and stages) later."""
    x = keras.Input((6,))
    h1 = layers.Dense(8, activation="relu")(x)
    h2 = layers.Dense(8, activation="relu")(h1)
    h3 = layers.Dense(8, activation="relu")(h2)
    h4 = layers.Dense(8)(h3)
    u1 = layers.Add()([h4, h3])
    u2 = layers.Concatenate()([layers.Dense(8)(u1), h2])
    u3 = layers.Add()([layers.Dense(8)(u2), h1])
    out = layers.Dense(2)(layers.Concatenate()([u3, x]))
    return keras.Model(x, out)


def multi_io_dict():
    """Dict inputs and outputs; a model input read late and a model output produced early."""
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    early = layers.Dense(4, name="early_head")(a)
    h = layers.Dense(6, activation="relu")(a)
    h = layers.Dense(6, activation="relu")(h)
    h = layers.Dense(6)(h)
    late = layers.Dense(2, name="late_head")(layers.Concatenate()([h, b]))
    return keras.Model({"a": a, "b": b}, {"early": early, "late": late})


def multi_io_list():
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = layers.Dense(6, activation="relu")(a)
    g = layers.Dense(6, activation="relu")(b)
    h = layers.Multiply()([h, g])
    return keras.Model([a, b], [layers.Dense(2)(h), layers.Dense(1)(g), h])


def shared_layers():
    """Tied weights: one Dense called at the start and at the end (different stages)."""
    x = keras.Input((6,))
    tied = layers.Dense(6, activation="tanh", name="tied")
    h = tied(x)
    for _ in range(4):
        h = layers.Dense(6, activation="relu")(h)
    h = tied(h)
    h = tied(layers.Add()([h, x]))
    return keras.Model(x, layers.Dense(2)(h))


def nested_models():
    """A Sequential and a functional model used as layers, one of them twice."""
    block_in = keras.Input((6,))
    block_out = layers.Dense(6)(layers.Dense(6, activation="relu")(block_in))
    block = keras.Model(block_in, layers.Add()([block_out, block_in]), name="block")
    tower = keras.Sequential(
        [keras.Input((6,)), layers.Dense(6, activation="relu"), layers.Dense(6)], name="tower"
    )
    x = keras.Input((6,))
    h = block(x)
    h = tower(h)
    h = block(h)
    return keras.Model(x, layers.Dense(2)(h))


def keras_ops_graph():
    x = keras.Input((6,))
    h = layers.Dense(8)(x)
    h = keras.ops.relu(h) * 2.0
    g = layers.Dense(8)(keras.ops.tanh(h))
    h = keras.ops.concatenate([h + g, keras.ops.sin(x)], axis=-1)
    return keras.Model(x, layers.Dense(2)(keras.ops.mean(keras.ops.stack([h, h * h]), axis=0)))


def batch_norm_conv():
    x = keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, padding="same")(x)
    h = layers.BatchNormalization()(h)
    h = layers.ReLU()(h)
    s = layers.Conv2D(4, 1)(x)
    h = layers.Add()([layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same")(h)), s])
    return keras.Model(x, layers.Dense(3)(layers.GlobalAveragePooling2D()(h)))


CASES = {
    "sequential_with_input": (sequential_with_input, lambda: rand(3, 6)),
    "sequential_with_input_shape": (sequential_with_input_shape, lambda: rand(3, 6)),
    "sequential_built_by_calling": (sequential_built_by_calling, lambda: rand(3, 6)),
    "sequential_built_by_build": (sequential_built_by_build, lambda: rand(3, 6)),
    "skip_connections": (skip_connections, lambda: rand(3, 6)),
    "multi_io_dict": (multi_io_dict, lambda: {"a": rand(3, 5), "b": rand(3, 3)}),
    "multi_io_list": (multi_io_list, lambda: [rand(3, 5), rand(3, 3)]),
    "shared_layers": (shared_layers, lambda: rand(3, 6)),
    "nested_models": (nested_models, lambda: rand(3, 6)),
    "keras_ops": (keras_ops_graph, lambda: rand(3, 6)),
    "batch_norm": (batch_norm_conv, lambda: rand(4, 8, 8, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_partitions", PARTITIONS)
def test_chained_stages_equal_model(case, num_partitions):
    build, make_input = CASES[case]
    model = build()
    plan = partition(model, num_partitions)
    check_plan(model, plan, make_input(), num_partitions, training=True)


@pytest.mark.parametrize("balance", ["layers", "params", "flops"])
def test_every_balance_gives_a_valid_plan(balance):
    model = skip_connections()
    plan = partition(model, 3, balance=balance, bandwidth=1e4)
    check_plan(model, plan, rand(3, 6), 3, gradients=False)
    assert all(stage.comm_cost >= 0 for stage in plan.stages)


def test_batch_norm_gets_the_training_flag():
    model = batch_norm_conv()
    plan = partition(model, 3)
    x = rand(4, 8, 8, 3) * 3 + 1
    training = np.asarray(plan.run(x, training=True))
    inference = np.asarray(plan.run(x, training=False))
    assert not np.allclose(training, inference)  # the flag really reaches the layers
    np.testing.assert_allclose(inference, np.asarray(model(x, training=False)), atol=1e-6)


def test_skip_tensor_is_forwarded_through_middle_stages():
    model = skip_connections()
    plan = partition(model, 4, balance="layers")
    forwarded = [b for stage in plan.stages for b in stage.sends if b.forwarded]
    assert forwarded, "a skip spanning stages must be passed on by the stages between"
    model_input = [b for b in forwarded if b.source_stage == -1]
    assert model_input and model_input[0].consumer_stages[-1] == 3


def test_model_output_produced_early_is_forwarded_to_the_end():
    model = multi_io_dict()
    plan = partition(model, 3)
    last = plan.stages[-1]
    early = [b for b in last.sends if b.name == "early_head"]
    assert early and early[0].dest_stage == -1
    assert early[0].source_stage == 0 and early[0].forwarded


def test_shared_layer_in_two_stages_is_listed_and_weights_not_copied():
    model = shared_layers()
    plan = partition(model, 3)
    assert plan.shared_layers["tied"] == [0, 1, 2]  # called three times
    tied = model.get_layer("tied")
    for index in (0, 2):
        kernels = [v for v in plan.stages[index].model.trainable_variables if v is tied.kernel]
        assert kernels, "stages must use the user's variable objects"
    assert plan.stages[0].owned_layers.count("tied") == 1
    assert "tied" not in plan.stages[2].owned_layers


def test_nested_model_layers_are_spread_over_stages():
    model = nested_models()
    plan = partition(model, 4)
    names = leaf_layer_names(model)
    assert any(n.startswith("block/") for n in names) and any(n.startswith("tower/") for n in names)
    stages_with_nested = {s.index for s in plan.stages for n in s.layers if "/" in n}
    assert len(stages_with_nested) > 1
    assert all("/" in name for name in plan.shared_layers)  # block is called twice


def test_nested_model_called_with_training_false_stays_one_node():
    inner = keras.Sequential([keras.Input((4,)), layers.BatchNormalization()], name="frozen")
    x = keras.Input((4,))
    h = layers.Dense(4)(x)
    out = layers.Dense(2)(inner(h, training=False))
    model = keras.Model(x, out)
    plan = partition(model, 3)
    assert sum("frozen" in s.layers for s in plan.stages) == 1
    assert not any(name.startswith("frozen/") for s in plan.stages for name in s.layers)
    check_plan(model, plan, rand(3, 4) * 2 + 1, 3, training=True, expected=_top_names(model))


def test_nested_models_whose_layers_share_names_stay_one_node_each():
    """Two encoders side by side, each with its own "embedding" (CLIP's, SigLIP's): inlined,
    a stage would hold two layers of one name, which keras.Model refuses."""

    def encoder(name):
        inputs = keras.Input((6,))
        hidden = layers.Dense(4, name="embedding")(inputs)
        return keras.Model(inputs, layers.Dense(4, name="projection")(hidden), name=name)

    x = keras.Input((6,))
    joined = layers.Concatenate()([encoder("image")(x), encoder("text")(x)])
    model = keras.Model(x, layers.Dense(2, name="head")(layers.Dense(4)(joined)))
    plan = partition(model, 2)
    held = [name for s in plan.stages for name in s.layers]
    assert "image" in held and "text" in held and not any("/" in name for name in held)
    check_plan(model, plan, rand(3, 6), 2, training=True, expected=_top_names(model))


def test_dense_layers_of_different_names_land_in_one_stage_each():
    model = sequential_with_input()
    plan = partition(model, 4)
    assert [s.layers for s in plan.stages] == [[layer.name] for layer in model.layers]


def test_regularization_losses_per_stage():
    x = keras.Input((4,))
    tied = layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.1), name="tied")
    h = tied(x)
    h = layers.Dense(4, kernel_regularizer="l1", activity_regularizer="l2")(h)
    h = layers.Dense(4)(h)
    model = keras.Model(x, tied(h))
    plan = partition(model, 3)
    assert plan.shared_layers == {"tied": [0, 2]}
    x_value = rand(2, 4)
    values, owned = [x_value], []
    for stage in plan.stages:
        values = stage.forward(values)
        owned.append(sum(float(loss) for loss in stage.owned_losses()))
    # stage.model.losses counts the regularizers of all layers the stage calls...
    assert len(plan.stages[2].model.losses) == 1  # tied's kernel, owned by stage 0
    assert owned[2] == 0.0
    # ...and owned losses add up to the model's, each regularizer counted once
    model(x_value)
    assert sum(owned) == pytest.approx(sum(float(loss) for loss in model.losses), rel=1e-6)


def test_single_partition_computes_the_whole_model():
    model = multi_io_list()
    plan = partition(model, 1)
    assert len(plan.stages) == 1
    stage = plan.stages[0]
    assert stage.receives[0].source_stage == -1 and stage.sends[0].dest_stage == -1
    check_plan(model, plan, [rand(2, 5), rand(2, 3)], 1)


def test_explicit_split_by_layer_names():
    model = sequential_with_input()
    names = [layer.name for layer in model.layers]
    plan = partition(model, 4, balance=names[1:])
    assert [s.layers for s in plan.stages] == [[n] for n in names]
    assert plan.to_dict()["balance"] == names[1:]


def test_types_and_json():
    model = skip_connections()
    plan = partition(model, 2)
    assert isinstance(plan, Plan) and all(isinstance(s, Stage) for s in plan.stages)
    assert all(isinstance(b, BoundaryTensor) for s in plan.stages for b in s.sends)
    data = json.loads(plan.to_json())
    assert data["num_partitions"] == 2
    assert data["stages"][1]["receives"] == data["stages"][0]["sends"]
    assert sum(s["param_count"] for s in data["stages"]) == model.count_params()
    first = model.layers[1]
    assert plan.layer(first.name) is first


def test_summary_table():
    model = skip_connections()
    plan = partition(model, 3, balance="flops")
    printed = []
    text = plan.summary(print_fn=printed.append)
    assert printed == [text]
    lines = text.splitlines()
    assert "stage" in lines[1] and "params" in lines[1] and "sent/sample" in lines[1]
    assert len(lines) >= 2 + 3 + 1 and "imbalance (slowest/mean)" in text


@pytest.mark.parametrize(
    "num_partitions, balance, message",
    [
        (0, "layers", "num_partitions"),
        (-1, "layers", "num_partitions"),
        (9, "layers", "only 8 layer calls"),
        (2, "nope", "balance must be one of"),
        (2, ["no_such_layer"], "Unknown layer names"),
        (3, ["dense_x"], "needs 2 layer names"),
        (2, ["first"], "empty stage"),
        (3, ["second", "second"], "empty stage"),
    ],
)
def test_errors_name_the_fix(num_partitions, balance, message):
    x = keras.Input((3,))
    h = layers.Dense(3, name="first")(x)
    h = layers.Dense(3, name="second")(h)
    for _ in range(6):
        h = layers.Dense(3)(h)
    model = keras.Model(x, h)
    with pytest.raises(ValueError, match=message):
        partition(model, num_partitions, balance=balance)


def test_subclassed_model_is_refused_with_advice():
    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Custom()
    model(rand(2, 3))
    with pytest.raises(ValueError, match='functional or Sequential.*strategy="data"'):
        partition(model, 2)


def test_unbuilt_sequential_is_refused_with_advice():
    model = keras.Sequential([layers.Dense(3), layers.Dense(2)])
    with pytest.raises(ValueError, match="not built.*build"):
        partition(model, 2)


def _top_names(model):
    return {op.name for op in model.operations if not isinstance(op, keras.layers.InputLayer)}


def test_repeated_outputs_and_an_input_returned_as_output():
    x = keras.Input((4,), name="x")
    h = layers.Dense(4)(x)
    y = layers.Dense(3)(layers.Dense(4)(h))
    model = keras.Model(x, [y, h, y, x])
    plan = partition(model, 3)
    names = [b.name for b in plan.stages[-1].sends]
    assert len(set(names)) == 4
    assert plan.stages[-1].sends[3].source_stage == -1 and plan.stages[-1].sends[3].forwarded
    check_plan(model, plan, rand(2, 4), 3)


def test_user_model_still_saves_and_loads_after_partitioning(tmp_path):
    model = nested_models()
    for k in (2, 3):
        partition(model, k)
    x = rand(2, 6)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), atol=1e-6)
    assert len(loaded.layers) == len(model.layers)


def test_models_nested_two_deep_with_dict_inputs_and_an_unused_output():
    p, q = keras.Input((4,), name="p"), keras.Input((4,), name="q")
    unused_head = layers.Dense(3, name="unused_head")
    two_io = keras.Model({"p": p, "q": q}, [layers.Dense(4)(p), unused_head(q)], name="two_io")
    middle_in = keras.Input((4,))
    y, _ = two_io({"p": middle_in, "q": layers.Dense(4, name="to_q")(middle_in)})
    middle = keras.Model(middle_in, layers.Add()([y, middle_in]), name="middle")
    x = keras.Input((4,))
    model = keras.Model(x, layers.Dense(2)(middle(layers.Dense(4)(x))))
    dead = {"middle/two_io/unused_head", "middle/to_q"}  # they compute nothing used
    assert dead < leaf_layer_names(model)
    expected = leaf_layer_names(model) - dead
    for k in (2, 3, 4):
        check_plan(model, partition(model, k), rand(3, 4), k, training=True, expected=expected)


def _masked_model():
    tokens = keras.Input((6,), dtype="int32")
    x = layers.Embedding(20, 4, mask_zero=True, name="table")(tokens)
    x = layers.Dense(4, name="projection")(x)  # passes the mask on
    x = layers.GRU(5, name="gru")(x)  # reads it
    x = layers.Dense(4, name="after")(x)
    return keras.Model(tokens, layers.Dense(3, name="head")(x))


@pytest.mark.parametrize("balance", ["layers", "params", "flops"])
def test_no_stage_begins_where_a_keras_mask_would_be_cut_off(balance):
    model = _masked_model()
    for parts in (2, 3):
        plan = partition(model, parts, balance=balance)
        for stage in plan.stages:  # masking layer and mask readers in one stage
            names = set(stage.layers)
            together = {"table", "projection", "gru"}
            assert not names & together or together <= names, [s.layers for s in plan.stages]
        tokens = np.array([[3, 4, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
        np.testing.assert_allclose(plan.run(tokens), model(tokens), atol=1e-6)


class _PositionTable(layers.Layer):
    """keras_hub 0.32's MoonshineRotaryEmbedding in small: one (length, 4) table per batch,
    declared as one value per sample."""

    def call(self, x):
        positions = keras.ops.cast(keras.ops.arange(keras.ops.shape(x)[1]), "float32")
        return keras.ops.stack([positions * k for k in (1.0, 2.0, 3.0, 4.0)], axis=-1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0],)


class _AddTable(layers.Layer):
    def call(self, x, table):
        return x + keras.ops.expand_dims(table, 0)


def _table_model():
    x = keras.Input((5, 4))
    table = _PositionTable(name="table")(x)
    h = layers.Dense(4, name="first")(x)
    h = _AddTable(name="add_1")(h, table)
    h = layers.Dense(4, name="second")(h)
    h = _AddTable(name="add_2")(h, table)
    h = layers.Dense(4, name="third")(h)
    return keras.Model(x, layers.Dense(3, name="head")(h))


def test_no_stage_receives_a_tensor_that_does_not_follow_the_batch_or_its_declared_shape():
    model = _table_model()  # without the traced shapes, 2 stages would send the table
    together = {"table", "add_1", "second", "add_2"}
    x = rand(3, 5, 4)
    for parts in (2, 3):
        plan = partition(model, parts)
        for stage in plan.stages:
            names = set(stage.layers)
            assert not names & together or together <= names, [s.layers for s in plan.stages]
        np.testing.assert_allclose(plan.run(x), model(x), atol=1e-6)
    with pytest.raises(ValueError, match="'table'.*cannot cross a stage boundary.*computed"):
        partition(model, 2, balance=["second"])


class _Rows(layers.Layer):
    """A reshape to -1 rows: traced at unknown lengths, its batch is unknown too."""

    def call(self, x):
        return keras.ops.reshape(x, (-1, keras.ops.shape(x)[1], 4))


def test_a_tensor_whose_batch_the_trace_cannot_see_is_cut_where_nothing_else_is_left():
    x = keras.Input((None, 4))
    h = _Rows(name="rows")(layers.Dense(4, name="first")(x))
    h = layers.Dense(4, name="second")(h)
    model = keras.Model(x, layers.Dense(3, name="head")(layers.Dense(4, name="third")(h)))
    data = rand(3, 6, 4)
    for parts in (2, 5):  # 5 stages for 5 layer calls: a stage begins after "rows"
        np.testing.assert_allclose(partition(model, parts).run(data), model(data), atol=1e-6)


def test_an_explicit_split_cutting_a_mask_is_refused():
    with pytest.raises(ValueError, match="separate a Keras mask"):
        partition(_masked_model(), 2, balance=["gru"])
    with pytest.raises(ValueError, match="places to cut"):
        partition(_masked_model(), 5)  # only 3 places to cut: before the table, after gru, head
