"""What the planner times besides the simulator's costs: tensor shares and the host's extra work.

`simulate.measure.measure_model` gives each layer's forward and backward and the engine's costs
around them. Tensor ranks and ZeRO-1 add what it does not time: each layer's `TensorShare`
(`tensor_traffic.py`), the host round trip of an in-graph collective (a compiled call of a host
function, as `comm/in_graph.py` runs MPI), and ZeRO-1's host work per step beyond plain data
parallelism's (`engine/zero.py` copies every gradient out and assigns every gathered parameter
back). `with_planner_costs` adds them to the `ModelCosts`, which `tensor_price.py` and
`simulate.predict` read.
"""

from __future__ import annotations

import statistics
import timeit
from dataclasses import replace

import numpy as np
import tensorflow as tf

from hyparflow.auto.tensor_traffic import stored_bytes, tensor_shares
from hyparflow.partitioner import profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.simulate.costs import ModelCosts, TensorShare
from hyparflow.tensor import tensor_layout
from hyparflow.traced import traced


def with_planner_costs(
    costs: ModelCosts, model, batch_size: int, input_shape=None, tensor_parts: int = 2,
    repeats: int = 3,
) -> ModelCosts:  # fmt: skip
    """`costs` of `model` with each layer's share under `tensor_parts` tensor ranks (per
    sample, at `batch_size` samples of `input_shape`) and the engine's `collective_call`,
    `zero_per_byte` and `zero_per_variable` (medians of `repeats` timings)."""
    graph = build_graph(model)
    sample = profile.make_sample(graph, input_shape=input_shape, batch_size=batch_size)
    shares = _tensor_shares(model, graph, sample, tensor_parts)
    layers = [replace(layer, tensor=share) for layer, share in zip(costs.layers, shares,
                                                                   strict=True)]  # fmt: skip
    per_byte, per_variable = _zero_host_costs(model.trainable_variables, repeats)
    engine = replace(costs.engine, collective_call=_collective_call_cost(repeats),
                     zero_per_byte=per_byte, zero_per_variable=per_variable)  # fmt: skip
    measured = {**costs.measured, "tensor_parts": tensor_parts}
    return replace(costs, layers=layers, engine=engine, measured=measured)


def _tensor_shares(model, graph, sample, parts: int) -> list[TensorShare]:
    """Each node's `TensorShare` under `parts` tensor ranks (none where no layout splits)."""
    try:
        layout = tensor_layout(model, parts)
    except ValueError:  # hf.fit refuses this T for the model: nothing splits
        return [TensorShare()] * len(graph.nodes)
    return tensor_shares(graph, layout, sample)


def _collective_call_cost(repeats: int) -> float:
    """Seconds an in-graph collective adds besides MPI's own: a compiled call of a host
    function on a small tensor, less an empty compiled call."""
    x = tf.zeros([256])
    host = traced(lambda t: tf.numpy_function(np.copy, [t], tf.float32, stateful=True))
    empty = traced(tf.identity)
    return max(0.0, _median_seconds(host, repeats, x) - _median_seconds(empty, repeats, x))


def _zero_host_costs(variables, repeats: int) -> tuple[float, float]:
    """(seconds per byte, per variable) of ZeRO-1's host work: a read and an assign of every
    variable and of the smaller half, solved for both terms (each kept >= 0)."""
    ordered = sorted(variables, key=stored_bytes)
    half = ordered[: len(ordered) // 2]
    if not half:
        return 0.0, 0.0
    (n_all, b_all), (n_half, b_half) = [
        (len(s), sum(map(stored_bytes, s))) for s in (ordered, half)
    ]
    t_all, t_half = (_median_seconds(_read_and_assign, repeats, s) for s in (ordered, half))
    determinant = n_all * b_half - n_half * b_all
    if determinant == 0:
        return t_all / max(b_all, 1), 0.0
    per_variable = (t_all * b_half - t_half * b_all) / determinant
    per_byte = (n_all * t_half - n_half * t_all) / determinant
    if per_variable < 0:
        return t_all / b_all, 0.0
    if per_byte < 0:
        return 0.0, t_all / n_all
    return per_byte, per_variable


def _read_and_assign(variables) -> None:
    for v in variables:
        v.assign(np.asarray(v.numpy()).reshape(tuple(v.shape)))


def _median_seconds(function, repeats: int, *args) -> float:
    function(*args)  # traces
    return statistics.median(timeit.repeat(lambda: function(*args), number=1, repeat=repeats))
