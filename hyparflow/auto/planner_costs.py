"""What the planner times besides the simulator's costs: tensor shares and the host's extra work.

`simulate.measure.measure_model` gives each layer's forward and backward and the engine's costs
around them. Tensor ranks and ZeRO-1 add what it does not time: each layer's `TensorShare`
(`tensor_traffic.py`), the host round trip of an in-graph collective (a compiled call of a host
function, as `comm/in_graph.py` runs MPI), and ZeRO-1's host work per step beyond plain data
parallelism's (`engine/sharded_optimizer/sharded_update.py` moves every gradient and parameter byte
through host buffers), timed on the engine's own reduction and update. `with_planner_costs` adds
them to the `ModelCosts`, which `tensor_price.py` and `simulate.predict` read. Costs timed layer
by layer (`simulate/by_layer.py`, a model whose weights are never read) take the shares from a
trace of the graph and ZeRO-1's host cost from the engine's stand-in model (`engine_proxy.py`).
"""

from __future__ import annotations

import contextlib
import statistics
import timeit
from dataclasses import replace

import keras
import numpy as np
import tensorflow as tf

from hyparflow.auto.tensor_traffic import tensor_shares
from hyparflow.comm.topology import Topology
from hyparflow.engine.gradients.sync import GradientSync
from hyparflow.engine.gradients.update import Update
from hyparflow.engine.sharded_optimizer.sharded_update import ShardedUpdate
from hyparflow.engine.weights import nbytes
from hyparflow.partitioner import profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.simulate.costs import ModelCosts, TensorShare
from hyparflow.simulate.engine_proxy import proxy_model
from hyparflow.tensor import tensor_layout
from hyparflow.traced import traced

CALLS = 50  # compiled calls per timing of a collective's host round trip


def with_planner_costs(
    costs: ModelCosts,
    model,
    batch_size: int,
    input_shape=None,
    tensor_parts: int = 2,
    repeats: int = 3,
) -> ModelCosts:
    """`costs` of `model` with each layer's share under `tensor_parts` tensor ranks (per
    sample, at `batch_size` samples of `input_shape`) and the engine's `collective_call` and
    `sharded_update_per_byte` (medians of `repeats` timings)."""
    by_layer = "by_layer" in costs.measured  # the model's weights are never read: traced
    graph = build_graph(model)
    sample = profile.make_sample(graph, input_shape=input_shape, batch_size=batch_size)
    shares = _tensor_shares(model, graph, sample, tensor_parts, by_layer)
    layers = [
        replace(layer, tensor=share) for layer, share in zip(costs.layers, shares, strict=True)
    ]
    engine = replace(
        costs.engine,
        collective_call=_collective_call_cost(repeats),
        sharded_update_per_byte=_sharded_update_cost(
            proxy_model(model.optimizer) if by_layer else model, repeats
        ),
    )
    measured = {**costs.measured, "tensor_parts": tensor_parts}
    return replace(costs, layers=layers, engine=engine, measured=measured)


def _tensor_shares(model, graph, sample, parts: int, traced_only: bool) -> list[TensorShare]:
    """Each node's `TensorShare` under `parts` tensor ranks (none where no layout splits);
    `traced_only`: from a trace of the graph, not a run."""
    try:
        layout = tensor_layout(model, parts)
    except ValueError:  # hf.fit refuses this T for the model: nothing splits
        return [TensorShare()] * len(graph.nodes)
    return tensor_shares(graph, layout, sample, traced_only)


def _collective_call_cost(repeats: int) -> float:
    """Seconds an in-graph collective adds besides MPI's own: a compiled call of a host
    function on a small tensor, less an empty compiled call (the fastest of `repeats` runs of
    `CALLS` each: tens of microseconds, which interference only lengthens)."""
    x = tf.zeros([256])
    host = traced(lambda t: tf.numpy_function(np.copy, [t], tf.float32, stateful=True))
    empty = traced(tf.identity)
    seconds = []
    for function in (host, empty):
        function(x)  # traces
        runs = timeit.repeat(lambda f=function: f(x), number=CALLS, repeat=max(repeats, 3))
        seconds.append(min(runs) / CALLS)
    return max(0.0, seconds[0] - seconds[1])


class _HeldGradients:
    """A runner's hand-over of a step's gradients (`engine/stages/runner.py`), as a list of zeros:
    all that the update paths read of a runner."""

    layout = None  # gradients as a list, not flat
    slice_gradients = False  # each variable's whole gradient, to be reduced

    def __init__(self, variables):
        self._gradients = [tf.zeros_like(v) for v in variables]

    def take_gradients(self) -> list:
        return list(self._gradients)


def _sharded_update_cost(model, repeats: int) -> float:
    """Seconds per parameter byte that ZeRO-1's reduction and update
    (`engine/sharded_optimizer/sharded_update.py`) add to data parallelism's (`GradientSync`,
    `Update`): both run for real on one replica (MPI.COMM_SELF) of a copy of `model` each, where
    they step the same bytes. 0 where the model cannot be copied (ZeRO-1 is then priced by its
    optimizer and broadcasts alone)."""
    seconds = []
    for sharded in (True, False):  # one copy at a time
        clone = _copy(model)
        if clone is None:
            return 0.0
        seconds.append(_update_seconds(clone, sharded, repeats))
    sharded, whole = seconds
    return max(0.0, sharded - whole) / max(1, sum(map(nbytes, model.trainable_variables)))


def _copy(model):
    """A fresh copy of `model` compiled with an unbuilt copy of its optimizer; None where Keras
    cannot clone it (a subclassed model without its config, a layer that cannot be rebuilt:
    only that is caught, so that a failure of the timing itself is not priced at 0)."""
    try:
        clone = keras.models.clone_model(model)
    except (TypeError, ValueError, NotImplementedError):
        return None
    clone.compile(keras.optimizers.deserialize(keras.optimizers.serialize(model.optimizer)))
    return clone


def _update_seconds(clone, sharded: bool, repeats: int) -> float:
    """Median seconds of one reduction and update of `clone` (a fresh copy of a model) on one
    replica: ZeRO-1's (`sharded`) or data parallelism's."""
    from mpi4py import MPI  # on use: importing it initialises MPI

    variables = list(clone.trainable_variables)
    topology = Topology.create(MPI.COMM_SELF, 1, 1)
    sync = GradientSync(
        topology,
        _HeldGradients(variables),
        variables,
        list(range(len(variables))),
        [],
        backend="mpi",
        shared=None,
        overlap=None,
    )
    update = Update(
        clone, topology, variables, variables, partitioned=False, guard=_unguarded, merge=sync.merge
    )
    if sharded:
        sharded_update = ShardedUpdate(clone, topology, variables, update, sync)
        return _median_seconds(
            lambda: sharded_update.apply(sharded_update.reduce().give_up()), repeats
        )
    return _median_seconds(lambda: update.apply(sync.reduce().give_up()), repeats)


def _unguarded(*args, **kwargs):
    return contextlib.nullcontext()


def _median_seconds(function, repeats: int, *args) -> float:
    function(*args)  # traces
    return statistics.median(timeit.repeat(lambda: function(*args), number=1, repeat=repeats))
