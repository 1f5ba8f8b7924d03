"""`partition()`: from a Keras model to a balanced `Plan` of pipeline stages."""

from __future__ import annotations

import numbers

from hyparflow.partitioner import balance as balancing
from hyparflow.partitioner import cost, profile
from hyparflow.partitioner.graph import build_graph
from hyparflow.partitioner.plan import Plan
from hyparflow.partitioner.stages import build_stages
from hyparflow.partitioner.traced_shapes import unsendable_tensors

BALANCES = ("layers", "params", "flops", "time")
TIME_REFINEMENTS = 3  # extra split-and-measure rounds for balance="time"
TIME_IMBALANCE_GOAL = 1.05  # stop refining once the slowest stage is this close to the mean
_COST_UNITS = {"layers": "layers", "params": "params", "flops": "FLOP", "time": "s"}


def partition(
    model,
    num_partitions: int,
    balance="layers",
    sample=None,
    input_shape=None,
    batch_size: int | None = None,
    bandwidth: float | None = None,
    uncut=None,
) -> Plan:
    """Split a functional or Sequential Keras model into `num_partitions` pipeline stages.

    Each stage is a `keras.Model` that calls the user's own layer objects (weights are shared,
    not copied); stage i+1 takes exactly the outputs of stage i, tensors needed further on are
    forwarded, and chaining all stages computes `model(x)`.

    Args:
        model: a functional or Sequential `keras.Model` (built). Nested functional/Sequential
            models are inlined, so their layers can go to different stages.
        num_partitions: number of stages (>= 1, at most the number of layer calls).
        balance: what to equalize across stages: "layers" (layer calls), "params", "flops"
            (analytic estimate), "time" (each layer timed forward+backward on a sample batch;
            the stages are then timed too, see `Plan.summary()`), or a list of
            `num_partitions - 1` layer names where stages 1, 2, ... begin.
        sample: a batch of inputs (anything `model` accepts) for balance="time".
        input_shape: input shape(s) without the batch dimension, for balance="time" when the
            model's input shapes have unknown dimensions and no `sample` is given.
        batch_size: samples per batch for the profiling sample (default 32) and for the
            communication cost (default: the sample's batch, else 1).
        bandwidth: if given, a stage's cost also includes the bytes it receives and sends,
            divided by `bandwidth` (bytes per unit of cost: bytes/second with "time").
        uncut: optional `uncut(graph) -> positions` where no stage should begin if the stages
            still fit elsewhere (tensor parallelism keeps its layer pairs in one stage).

    Returns:
        A `Plan`: `plan.stages[i].model`, `.receives`, `.sends`, `.layers`, `.cost`;
        `plan.run(x)`, `plan.summary()`, `plan.to_json()`.

    For example:
        plan = hyparflow.partition(model, 4, balance="time", batch_size=64)
        plan.summary()
        assert np.allclose(plan.run(x), model(x))
    """

    if not isinstance(num_partitions, numbers.Integral) or num_partitions < 1:
        raise ValueError(f"num_partitions must be an integer >= 1, got {num_partitions!r}.")
    num_partitions = int(num_partitions)
    explicit = isinstance(balance, (list, tuple))
    if not explicit and balance not in BALANCES:
        raise ValueError(
            f"balance must be one of {BALANCES} or a list of layer names where stages begin; "
            f"got {balance!r}."
        )
    graph = build_graph(model)
    n = len(graph.nodes)
    if num_partitions > n:
        raise ValueError(
            f"Cannot split '{model.name}' into {num_partitions} stages: it has only {n} layer "
            f"calls. Use num_partitions <= {n} (or more replicas instead of more stages)."
        )

    if explicit or balance == "layers":
        node_costs = cost.layer_costs(graph)
    elif balance == "params":
        node_costs = cost.param_costs(graph)
    elif balance == "flops":
        node_costs = cost.flop_costs(graph)
    else:
        return _partition_by_time(
            graph, num_partitions, sample, input_shape, batch_size, bandwidth, uncut
        )

    cut_costs = cost.cut_costs(graph, batch_size or 1, bandwidth) if bandwidth else None
    unsendable = unsendable_tensors(graph) if num_partitions > 1 else {}
    if explicit:
        starts = _starts_from_names(graph, list(balance), num_partitions)
        _check_masks(graph, starts, graph.masked_cuts())
        _check_unsendable(graph, starts, unsendable)
    else:
        pinned = _pinned(graph, unsendable)
        starts = _split_keeping(uncut, graph, node_costs, num_partitions, cut_costs, pinned)
    stages, shared = build_stages(graph, starts, node_costs, cut_costs)
    return Plan(
        model=model,
        stages=stages,
        balance=balance,
        shared_layers=shared,
        cost_unit="layers" if explicit else _COST_UNITS[balance],
        batch_size=batch_size,
        bandwidth=bandwidth,
        graph=graph,
    )


def _pinned(graph, unsendable: dict) -> list[set[int]]:
    """Positions where no stage may begin, the strictest first: where a mask, or a tensor
    that cannot be sent (proven or not) is alive; then where a mask or a proven one is."""
    masked = graph.masked_cuts()
    certain = [t for t, why in unsendable.items() if why.certain]
    return [masked | graph.alive_across(unsendable), masked | graph.alive_across(certain)]


def _split_keeping(uncut, graph, node_costs, num_partitions, cut_costs, pinned) -> list[int]:
    """Balanced stage starts, none at a pinned position (`_pinned`: the first set that leaves
    enough places to cut) nor, where the stages still fit, at a position `uncut(graph)` names
    (layers that should stay in one stage)."""
    kept = set(uncut(graph)) if uncut is not None else set()
    # each distinct set once (the sets coincide unless an unproven tensor or `uncut` adds one)
    tries = list(dict.fromkeys(frozenset(p) for p in [*(p | kept for p in pinned), pinned[-1]]))
    for positions in tries[:-1]:
        try:
            return balancing.split_between(node_costs, num_partitions, cut_costs, positions)
        except ValueError:
            continue  # too few places left to cut: bind fewer
    return balancing.split_between(node_costs, num_partitions, cut_costs, tries[-1])


def _partition_by_time(
    graph, num_partitions, sample, input_shape, batch_size, bandwidth, uncut=None
):
    """Split by profiled node times, then time the stages and correct the split with them.

    Layers timed alone do not add up exactly to a stage timed whole (caches, fusion, memory
    traffic), so each round scales the node times of every stage by measured / estimated and
    splits again; the plan with the lowest measured imbalance is kept.
    """

    inputs = profile.make_sample(graph, sample, input_shape, batch_size)
    samples = int(inputs[0].shape[0])
    node_costs = profile.node_times(graph, inputs)
    pinned = _pinned(graph, unsendable_tensors(graph))
    cut_costs = cost.cut_costs(graph, samples, bandwidth) if bandwidth else None
    best = None
    tried = set()
    for _ in range(1 + TIME_REFINEMENTS):
        starts = _split_keeping(uncut, graph, node_costs, num_partitions, cut_costs, pinned)
        if tuple(starts) in tried:
            break
        tried.add(tuple(starts))
        stages, shared = build_stages(graph, starts, node_costs, cut_costs)
        times = profile.stage_times(stages, inputs, graph.model)
        imbalance = max(times) / (sum(times) / len(times))
        if best is None or imbalance < best[0]:
            best = (imbalance, stages, shared, times)
        if imbalance <= TIME_IMBALANCE_GOAL:
            break
        node_costs = _rescaled(node_costs, starts, stages, times)
    _, stages, shared, times = best
    for stage, seconds in zip(stages, times, strict=True):
        stage.measured_time = seconds
    return Plan(
        model=graph.model,
        stages=stages,
        balance="time",
        shared_layers=shared,
        cost_unit="s",
        batch_size=samples,
        bandwidth=bandwidth,
        graph=graph,
    )


def _rescaled(node_costs, starts, stages, times):
    """Node costs scaled per stage so that each stage's compute sums to its measured time."""
    scaled = node_costs.copy()
    bounds = [*starts, len(node_costs)]
    for k, stage in enumerate(stages):
        a, b = bounds[k], bounds[k + 1]
        estimated = node_costs[a:b].sum()
        measured_compute = max(times[k] - stage.comm_cost, 0.0)
        if estimated > 0:
            scaled[a:b] *= measured_compute / estimated
    return scaled


def _check_masks(graph, starts, masked) -> None:
    """Refuse an explicit split that would cut a Keras mask off from the layers reading it."""
    bad = [graph.nodes[p].name for p in starts if p in masked]
    if bad:
        raise ValueError(
            f"A stage beginning at {bad} would separate a Keras mask (e.g. from "
            "Embedding(mask_zero=True) or Masking) from the layers that read it, and masks do "
            "not cross stage boundaries; begin the stage before the masking layer or after "
            "the last layer reading the mask."
        )


def _check_unsendable(graph, starts, unsendable: dict) -> None:
    """Refuse an explicit split whose boundary would carry a tensor proven not to be sendable."""
    spans = {t: graph.alive_across([t]) for t, why in unsendable.items() if why.certain}
    for position in starts[1:]:
        crossing = [t for t, span in spans.items() if position in span]
        if crossing:
            t = crossing[0]
            raise ValueError(
                f"A stage beginning at '{graph.nodes[position].name}' would receive tensor "
                f"'{graph.tensors[t].name}', which cannot cross a stage boundary: its layer "
                f"{unsendable[t].reason}. A boundary tensor travels in slices of the batch with "
                "its declared shape; begin the stage before that tensor's layer or after its "
                "last reader."
            )


def _starts_from_names(graph, names, num_partitions) -> list[int]:
    """Node positions where stages begin, from layer (or node) names."""
    if len(names) != num_partitions - 1:
        raise ValueError(
            f"An explicit split for {num_partitions} stages needs {num_partitions - 1} layer "
            f"names (where stages 1..{num_partitions - 1} begin); got {len(names)}."
        )
    first_position = {}
    for node in graph.nodes:
        first_position.setdefault(node.name, node.position)
        first_position.setdefault(node.layer_name, node.position)
    unknown = [name for name in names if name not in first_position]
    if unknown:
        raise ValueError(
            f"Unknown layer names in the explicit split: {unknown}. Use names from the model's "
            "layers (nested layers as 'outer/inner'); see "
            "partition(model, 1).stages[0].nodes for the order."
        )
    starts = [0] + sorted(first_position[name] for name in names)
    if len(set(starts)) != len(starts):
        where = [name for name in names if first_position[name] == 0] or names
        raise ValueError(
            f"The explicit split {names} gives an empty stage (a stage beginning at the first "
            f"layer, or two stages beginning at the same layer: {where}). Name distinct layers "
            "after the first one."
        )
    return starts
