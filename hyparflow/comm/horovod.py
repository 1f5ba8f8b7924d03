"""Gradient reduction through Horovod's grouped allreduce, one process set per pipeline stage."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from hyparflow.comm.allreduce import OPS, reduction_dtype

MISSING = (
    "comm='horovod' needs Horovod built with TensorFlow and MPI support, which this Python "
    "cannot import ({error}). Build Horovod 0.28.1 from source against the installed "
    "TensorFlow with scripts/build_horovod.sh (see docs/horovod.md), or use comm='mpi'."
)

# Process sets this process added, by their sorted world ranks. Horovod refuses to add the same
# ranks twice, and every later Trainer over the same grid needs the same sets again.
_stage_sets: dict[tuple[int, ...], object] = {}


def import_horovod():
    """`horovod.tensorflow`, or an ImportError that says how to build it.

    For example:
        hvd = import_horovod()  # raises ImportError naming scripts/build_horovod.sh
    """
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:  # absent, or built without its TensorFlow extension
        raise ImportError(MISSING.format(error=error)) from error
    return hvd


def initialize(hvd, world) -> None:
    """Start Horovod over `world` with dynamic process sets, or check the running one fits.

    Dynamic process sets are what let every Trainer (any grid, created at any time) add the
    sets it needs; static ones can only be given once, to `hvd.init`. Collective over `world`.
    """
    if not hvd.is_initialized():
        hvd.init(comm=world, process_sets="dynamic")
    if (hvd.size(), hvd.rank()) != (world.Get_size(), world.Get_rank()):
        raise ValueError(
            f"Horovod runs as rank {hvd.rank()} of {hvd.size()}, but hyparflow's world as rank "
            f"{world.Get_rank()} of {world.Get_size()}; call hvd.init() over the whole MPI world "
            "(or leave hvd.init to hyparflow)."
        )


def stage_process_set(hvd, grid, stage: int):
    """Horovod's process set of `stage`'s replicas; None if it has only one (nothing to sum).

    Adds the sets of every stage not known yet, in stage order, so that all ranks make the same
    collective `add_process_set` calls.
    """
    for other in range(grid.partitions):
        ranks = tuple(grid.stage_ranks(other))
        if 1 < len(ranks) < hvd.size() and ranks not in _stage_sets:
            _stage_sets[ranks] = _add_process_set(hvd, ranks)
    ranks = tuple(grid.stage_ranks(stage))
    if len(ranks) == 1:
        return None
    return hvd.global_process_set if len(ranks) == hvd.size() else _stage_sets[ranks]


def _add_process_set(hvd, ranks: tuple[int, ...]):
    try:
        return hvd.add_process_set(list(ranks))
    except ValueError as error:
        raise ValueError(
            f"Horovod could not add the process set of ranks {list(ranks)} ({error}). hyparflow "
            "adds one per pipeline stage: start Horovod with hvd.init(process_sets='dynamic') "
            "and register no set of these ranks yourself, or leave hvd.init to hyparflow."
        ) from error


class HorovodReducer:
    """Sum (or average) a fixed list of gradients across a stage's replicas with Horovod.

    The drop-in alternative to `GradientReducer` for `hf.fit(..., comm="horovod")`: one
    `hvd.grouped_allreduce` per step over the Horovod process set holding exactly the world
    ranks of this stage's replicas (Horovod fuses the group into its own buffers). Like
    `GradientReducer`, `None` gradients reduce as zeros and come back as None, `IndexedSlices`
    are reduced dense, and float16/bfloat16 are summed in float32. `calls` counts the grouped
    allreduces issued. Creating one is collective over the whole world (Horovod's
    `hvd.init` and `hvd.add_process_set` are).

    Example:
        reducer = HorovodReducer(topo.world, topo.grid, topo.stage, specs=variables, op="sum")
        grads = reducer.reduce(grads)
    """

    def __init__(self, world, grid, stage: int, specs: Sequence, *, op: str = "mean"):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        self.hvd = import_horovod()
        initialize(self.hvd, world)
        self.process_set = stage_process_set(self.hvd, grid, stage)
        self.op = self.hvd.Sum if op == "sum" else self.hvd.Average
        self.specs = [_shape_and_dtype(spec) for spec in specs]
        self.calls = 0

    def reduce(self, grads: Sequence) -> list:
        """Reduce every gradient (blocking); the result has the inputs' order, shapes, dtypes."""
        if len(grads) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} gradients, got {len(grads)}")
        if self.process_set is None:
            return list(grads)
        dense = [self._dense(grad, spec) for grad, spec in zip(grads, self.specs, strict=True)]
        reduced = self.hvd.grouped_allreduce(dense, op=self.op, process_set=self.process_set)
        self.calls += 1
        return [
            None if grad is None else tf.cast(result, dtype)
            for grad, result, (_, dtype) in zip(grads, reduced, self.specs, strict=True)
        ]

    @staticmethod
    def _dense(grad, spec) -> tf.Tensor:
        shape, dtype = spec
        summed_as = tf.as_dtype(reduction_dtype(dtype))
        if grad is None:  # every replica must submit the same tensors
            return tf.zeros(shape, summed_as)
        grad = tf.convert_to_tensor(grad)  # densifies IndexedSlices
        if tuple(grad.shape) != shape:
            raise ValueError(f"gradient of shape {tuple(grad.shape)} where {shape} was planned")
        return tf.cast(grad, summed_as)  # no-op unless half precision


def _shape_and_dtype(spec) -> tuple[tuple[int, ...], tf.DType]:
    shape, dtype = (spec.shape, spec.dtype) if hasattr(spec, "dtype") else spec
    return tuple(tf.TensorShape(shape).as_list()), tf.as_dtype(dtype)
