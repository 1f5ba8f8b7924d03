"""Timing a model without its weights (hyparflow/simulate/by_layer.py): each distinct layer
built alone, a saved file read as its architecture under hf.scope(), and `plan --auto` on
both; the memory side counts the build it says."""

import json

import keras
import tensorflow as tf

import hyparflow as hf
from hyparflow import cli, deferred
from hyparflow.partitioner.graph import build_graph
from hyparflow.partitioner.source import load_architecture
from hyparflow.partitioner.traced_shapes import traced_specs
from hyparflow.simulate.by_layer import layer_key, measure_by_layer

NETWORK = ["--latency", "2e-6", "--bandwidth", "12e9"]


def repeated_blocks(blocks=3, width=32):
    """Blocks of Dense(4w) -> Dense(w), each block's layers named apart, and a head."""
    inputs = keras.Input((width,))
    x = inputs
    for _ in range(blocks):
        x = keras.layers.Dense(4 * width, activation="relu")(x)
        x = keras.layers.Dense(width)(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile("adam", "mse")
    return model


def _keys(model, batch=4):
    graph = build_graph(model)
    specs = traced_specs(graph, [tf.TensorSpec((batch, *model.input.shape[1:]))])
    return [layer_key(node, specs) for node in graph.nodes]


def test_repeated_blocks_share_a_key_and_other_shapes_or_configs_do_not():
    keys = _keys(repeated_blocks())
    assert keys[0] == keys[2] == keys[4] and keys[1] == keys[3] == keys[5]
    assert len(set(keys)) == 3  # the blocks' two layers and the head
    wider = _keys(repeated_blocks(blocks=1, width=16))
    assert not set(wider) & set(keys)  # other input shapes and units


def test_a_model_built_under_hf_scope_is_timed_without_allocating_its_weights():
    with hf.scope():
        model = repeated_blocks()
    costs = measure_by_layer(model, (2, 4), repeats=1)
    assert all(deferred.is_deferred(v) for v in model.trainable_variables)
    graph = build_graph(model)
    assert [layer.name for layer in costs.layers] == [node.name for node in graph.nodes]
    assert costs.measured["by_layer"]["distinct"] == 3
    assert costs.param_bytes == sum(4 * v.numpy().size for v in repeated_blocks().weights)
    same = {(c.forward, c.backward) for c in costs.layers[0:6:2]}
    assert len(same) == 1  # the repeated layer's one timing serves each of its calls
    assert all(c.forward.at(4) >= 0 and c.backward.at(4) >= 0 for c in costs.layers)
    assert costs.engine.loss.at(4) > 0 and costs.engine.optimizer_per_byte >= 0


def test_a_saved_file_is_read_as_its_architecture_without_its_weights(tmp_path):
    path = str(tmp_path / "model.keras")
    saved = repeated_blocks()
    saved.save(path)
    model = load_architecture(path)
    assert deferred.any_deferred(model) and all(
        deferred.is_deferred(v) for v in model.trainable_variables
    )
    assert [v.shape for v in model.weights] == [v.shape for v in saved.weights]
    assert type(model.optimizer) is type(saved.optimizer) and model.loss == saved.loss


def _plan(argv, capsys) -> tuple[dict, str]:
    assert cli.main(["plan", "--auto", *argv, *NETWORK, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_plan_auto_counts_the_build_it_says_and_takes_the_other(tmp_path, capsys):
    path = str(tmp_path / "model.keras")
    repeated_blocks(width=64).save(path)
    argv = [path, "--ranks", "2", "--batch", "8", "--profile-batch-sizes", "2,4"]
    scoped, said = _plan(argv, capsys)
    assert "memory: counted for a model built under hf.scope()" in said
    ordinary, said = _plan([*argv, "--build", "ordinary"], capsys)
    assert "memory: counted for a model built outside hf.scope()" in said

    def bytes_of(found, label):
        return next(e for e in found["ranked"] if e["label"] == label)["memory_per_rank_bytes"]

    label = "P2 R1 T1 M1 gpipe"  # a pipeline: under hf.scope() a rank holds only its stage
    assert bytes_of(scoped, label) < bytes_of(ordinary, label)


def test_a_model_built_outside_hf_scope_is_counted_ordinary(capsys):
    argv = ["tests.support.measure_models:tiny_mlp", "--ranks", "2", "--batch", "8"]
    _, said = _plan([*argv, "--profile-batch-sizes", "2,4"], capsys)
    assert "memory: counted for a model built outside hf.scope()" in said


def test_a_keras_hub_causal_lm_under_hf_scope_is_timed_at_its_data_shapes():
    """keras_hub's GPT-2 (inputs {"token_ids", "padding_mask"} of unknown lengths) built under
    hf.scope(): its layers timed at the lengths of its data, its tensor shares traced."""
    from hyparflow.auto.planner_costs import with_planner_costs
    from tests.support import hub_zoo

    x, _ = hub_zoo.data("GPT2", hub_zoo.compiled("GPT2"))
    shapes = {name: array.shape[1:] for name, array in x.items()}
    with hf.scope():
        model = hub_zoo.compiled("GPT2")
    costs = measure_by_layer(model, (2, 4), shapes, repeats=1)
    assert [layer.name for layer in costs.layers] == [n.name for n in build_graph(model).nodes]
    assert costs.measured["by_layer"]["distinct"] < len(costs.layers)  # its decoder blocks
    priced = with_planner_costs(costs, model, 2, shapes, 2, 1)
    assert any(layer.tensor.split_bytes > 0 for layer in priced.layers)
    assert any(layer.tensor.forward_bytes > 0 for layer in priced.layers)
    assert deferred.any_deferred(model)
