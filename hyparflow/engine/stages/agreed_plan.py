"""The pipeline plan every rank agrees on: one stage per pipeline rank, or several interleaved."""

from __future__ import annotations

from hyparflow import deferred
from hyparflow.comm.agree import agree
from hyparflow.partitioner import partition
from hyparflow.tensor import rules as tensor_rules


def agreed_plan(model, strategy, comm):
    """Partition the model identically on every rank (time-balanced plans are cut on rank 0):
    one stage per pipeline rank, or `virtual_stages` per rank for the interleaved schedule."""
    if strategy.partitions == 1:
        return None
    balance = strategy.balance
    uncut = tensor_rules.pair_cuts if strategy.tensor > 1 else None
    if balance == "time":
        agree(comm, _check_timeable, model)
        plan = agree(
            comm,
            lambda: (
                _partition_chunks(model, strategy, balance, uncut) if comm.Get_rank() == 0 else None
            ),
        )
        starts = comm.bcast(
            [s.layers[0] for s in plan.stages[1:]] if plan is not None else None, root=0
        )
        balance = starts
    plan = agree(comm, _partition_chunks, model, strategy, balance, uncut)
    plan.virtual_stages = strategy.virtual_stages
    return plan


def _partition_chunks(model, strategy, balance, uncut):
    """The plan of `partitions * virtual_stages` stages, an error naming both if it cannot be."""
    v = strategy.virtual_stages
    try:
        return partition(model, strategy.partitions * v, balance, uncut=uncut)
    except ValueError as error:
        if v == 1:
            raise
        raise ValueError(
            f"{error} With schedule='interleaved' the model is cut into partitions x "
            f"virtual_stages = {strategy.partitions} x {v} stages: lower virtual_stages."
        ) from None


def _check_timeable(model) -> None:
    if deferred.any_deferred(model):
        raise ValueError(
            "balance='time' times each layer by running it, which needs weights that a model "
            "built under hf.scope() does not hold; use balance='layers' (or 'params', "
            "'flops', or a list of stage starts)."
        )
