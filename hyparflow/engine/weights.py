"""Which stage owns which weight, and sharing owned weights between the ranks."""

from __future__ import annotations

import numpy as np


def first_users(plan, attribute: str = "weights") -> dict:
    """id(variable) -> the first stage whose sub-model holds it (`attribute`: "weights" or
    "trainable_variables" of each stage's model)."""
    first_user: dict = {}
    for stage in plan.stages:
        for v in getattr(stage.model, attribute):
            first_user.setdefault(id(v), stage.index)
    return first_user


def owned_variables(plan, stage_index: int) -> list:
    """Trainable variables whose regularization this stage counts: those first used here."""
    first_user = first_users(plan, "trainable_variables")
    return [
        v for v in plan.stages[stage_index].model.trainable_variables
        if first_user[id(v)] == stage_index
    ]  # fmt: skip


def weight_owners(plan, model) -> list:
    """For each of `model.weights`, the first stage that uses it (it holds the latest value)."""
    first_user = first_users(plan)
    return [first_user.get(id(v), 0) for v in model.weights]


def packed(variables) -> np.ndarray:
    """The values of `variables` in one float64 buffer (for one MPI call)."""
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables])


def assign_packed(variables, flat: np.ndarray) -> None:
    """Assign `variables` their values from a `packed` buffer."""
    offset = 0
    for v in variables:
        size = int(np.prod(v.shape))
        v.assign(flat[offset : offset + size].reshape(v.shape).astype(v.dtype))
        offset += size


def broadcast_owned_weights(model, plan, comm, guard) -> None:
    """Give every rank of the pipeline `comm` the full model: each stage broadcasts the weights
    it owns. `guard(operation, peer)` watches each broadcast."""
    owners = weight_owners(plan, model)
    for root in range(comm.Get_size()):
        mine = [v for v, owner in zip(model.weights, owners) if owner == root]
        if not mine:
            continue
        if comm.Get_rank() == root:
            flat = packed(mine)
        else:
            flat = np.empty(sum(int(np.prod(v.shape)) for v in mine), np.float64)
        with guard("share trained weights", peer=root):
            comm.Bcast(flat, root=root)
        if comm.Get_rank() != root:
            assign_packed(mine, flat)


def held_elsewhere(model, plan, stage_index: int, layout=None) -> list:
    """The model's variables this rank does not hold as they are: those only other pipeline
    stages use, and (under tensor parallelism) the whole forms of the variables it holds a
    shard of. A model built under hf.scope() leaves them unallocated."""
    mine = model.variables if plan is None else plan.stages[stage_index].model.variables
    ids = {id(v) for v in mine}
    others = [v for v in model.variables if id(v) not in ids]
    if layout is not None:
        others += [v for split in layout.splits for v, _ in split.axes.values()]
    return others
