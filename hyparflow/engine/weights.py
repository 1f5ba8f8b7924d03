"""Which stage owns which weight, and sharing owned weights between the ranks."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hyparflow.comm.allreduce import DEFAULT_BUCKET_BYTES
from hyparflow.moe import expert_weights


def first_users(plan, attribute: str = "weights") -> dict:
    """id(variable) -> the pipeline rank of the first stage whose sub-model holds it
    (`attribute`: "weights" or "trainable_variables" of each stage's model)."""
    first_user: dict = {}
    for stage in plan.stages:
        for v in getattr(stage.model, attribute):
            first_user.setdefault(id(v), plan.holder(stage.index))
    return first_user


def rank_variables(plan, rank: int, attribute: str = "trainable_variables") -> list:
    """The variables (`attribute` of each stage's model) of the stages pipeline rank `rank`
    runs, each once, in model order (one stage's, unless interleaved)."""
    seen, variables = set(), []
    for stage in plan.stages_on(rank):
        for v in getattr(stage.model, attribute):
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    return variables


def owned_variables(plan, rank: int) -> list:
    """Trainable variables whose regularization this pipeline rank counts: those first used
    here."""
    first_user = first_users(plan, "trainable_variables")
    return [v for v in rank_variables(plan, rank) if first_user[id(v)] == rank]


def weight_owners(plan, model) -> list:
    """For each of `model.weights`, the pipeline rank of the first stage that uses it (it
    holds the latest value)."""
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


# Weights travel in groups of about this many bytes (a larger weight alone, from and into its
# own buffer), so sharing them costs at most one group or one weight of memory at a time,
# never a packed copy of every weight a stage owns (docs/engine.md, "Memory").
BROADCAST_GROUP_BYTES = DEFAULT_BUCKET_BYTES


def byte_groups(variables, group_bytes: int = BROADCAST_GROUP_BYTES) -> list[list]:
    """`variables` in order, cut into groups of about `group_bytes` of raw bytes each (a group
    closes once it holds that many).

    Example:
        >>> v = [np.zeros(3, np.float32), np.zeros(8, np.float64), np.zeros(2, np.float32)]
        >>> [len(g) for g in byte_groups(v, group_bytes=16)]
        [2, 1]
    """
    groups, current, size = [], [], 0
    for v in variables:
        current.append(v)
        size += nbytes(v)
        if size >= group_bytes:
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


def numpy_dtype(v):
    """`v`'s dtype as numpy's (a variable's, or an array's)."""
    dtype = v.dtype
    return dtype if isinstance(dtype, np.dtype) else tf.as_dtype(dtype).as_numpy_dtype


def nbytes(v) -> int:
    """Bytes of `v`'s values (a variable, or anything with `shape` and `dtype`)."""
    return int(np.prod(v.shape)) * np.dtype(numpy_dtype(v)).itemsize


def broadcast_owned_weights(model, plan, comm, guard) -> None:
    """Give every rank of the pipeline `comm` the full model: each stage broadcasts the weights
    it owns, as raw bytes in groups of `BROADCAST_GROUP_BYTES` (any dtype, exact).
    `guard(operation, peer)` watches each broadcast."""
    owners = weight_owners(plan, model)
    for root in range(comm.Get_size()):
        mine = [v for v, owner in zip(model.weights, owners, strict=True) if owner == root]
        for group in byte_groups(mine):
            arrays = None
            if comm.Get_rank() == root:
                arrays = [np.ascontiguousarray(v.numpy()) for v in group]
                flat = (
                    arrays[0].reshape(-1).view(np.uint8)
                    if len(group) == 1
                    else (np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays]))
                )
            else:
                flat = np.empty(sum(nbytes(v) for v in group), np.uint8)
            with guard("share trained weights", peer=root):
                comm.Bcast(flat, root=root)
            if comm.Get_rank() != root:
                offset = 0
                for v in group:
                    size = nbytes(v)
                    v.assign(flat[offset : offset + size].view(numpy_dtype(v)).reshape(v.shape))
                    offset += size
            del arrays, flat


def held_elsewhere(model, plan, rank: int, layout=None, experts: int = 1) -> list:
    """The model's variables pipeline rank `rank` does not hold as they are: those only other
    ranks' stages use, and (under tensor or expert parallelism) the whole forms of the
    variables it holds a shard of. A model built under hf.scope() leaves them unallocated."""
    mine = model.variables if plan is None else rank_variables(plan, rank, "variables")
    ids = {id(v) for v in mine}
    others = [v for v in model.variables if id(v) not in ids]
    if layout is not None:
        others += [v for split in layout.splits for v, _ in split.axes.values()]
    if experts > 1:
        others += expert_weights(model)
    return others
