"""The gradient-reduction backends `hf.fit(comm=...)` chooses from: "mpi" or "horovod"."""

from __future__ import annotations

from collections.abc import Sequence

from hyparflow.comm.allreduce import GradientReducer
from hyparflow.comm.horovod import HorovodReducer, import_horovod

BACKENDS = ("mpi", "horovod")


def check_backend(backend: str) -> str:
    """`backend` if it is known and usable here, else an error naming what to change.

    Example:
        >>> check_backend("mpi")
        'mpi'
    """
    if backend not in BACKENDS:
        raise ValueError(f"comm must be one of {BACKENDS}, got {backend!r}")
    if backend == "horovod":
        import_horovod()
    return backend


def make_reducer(backend: str, topology, specs: Sequence, *, op: str = "sum"):
    """The reducer that sums gradients across the replicas of `topology`'s stage.

    "mpi": hyparflow's fused `GradientReducer` on `topology.stage_comm`; "horovod": a
    `HorovodReducer` over the Horovod process set of the same ranks. Both offer
    `reduce(grads) -> grads`. Collective over the whole world.

    For example:
        reducer = make_reducer("horovod", topo, model.trainable_variables)
    """
    check_backend(backend)
    if backend == "horovod":
        return HorovodReducer(topology.world, topology.grid, topology.stage, specs, op=op)

    return GradientReducer(topology.stage_comm, specs=specs, op=op)
