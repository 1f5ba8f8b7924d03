"""Gradient reduction across replicas in fused, reusable buckets (one MPI call per bucket).

Gradients are copied into a few contiguous buffers (one series of buckets per dtype; float16 and
bfloat16 are reduced in float32), each bucket is reduced in place with one MPI call (a
nonblocking `Iallreduce` as soon as its last gradient arrives when started one by one, a
blocking `Allreduce` in `reduce`), and results come back as views of the buckets in the original
shapes and order. `reduce_flat` reduces gradients that already are one buffer. Buckets are
allocated once and reused every step. Fusing follows Horovod's tensor fusion and PyTorch DDP's
gradient buckets (Li et al. 2020, "PyTorch Distributed").
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from hyparflow.comm.dlpack import ALIGNMENT, is_gpu_device, tensor_device, wrap_host_buffer
from hyparflow.comm.failure import wait_all
from hyparflow.comm.hugepages import huge_zeros, promote_tensor
from hyparflow.sizes import BUCKET_BYTES

DEFAULT_BUCKET_BYTES = BUCKET_BYTES  # why this size: hyparflow/sizes.py

OPS = ("sum", "mean")


def reduction_dtype(dtype) -> np.dtype:
    """The dtype a gradient is reduced in: half-precision floats go up to float32.

    MPI has no float16/bfloat16 sum, and summing many halves loses precision anyway.

    Example:
        >>> reduction_dtype(tf.bfloat16), reduction_dtype("float64")
        (dtype('float32'), dtype('float64'))
    """
    dtype = tf.as_dtype(dtype)
    if dtype in (tf.float16, tf.bfloat16):
        return np.dtype(np.float32)
    return np.dtype(dtype.as_numpy_dtype)


@dataclass
class Slot:
    """Where gradient `index` lives: bucket, element offset and its original shape and dtype."""

    index: int
    bucket: int
    offset: int
    shape: tuple[int, ...]
    dtype: tf.DType

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class Bucket:
    """One contiguous buffer of one dtype holding several gradients, reduced by one MPI call."""

    dtype: np.dtype
    indices: list[int] = field(default_factory=list)
    length: int = 0  # elements, including alignment padding

    @property
    def nbytes(self) -> int:
        return self.length * self.dtype.itemsize


def plan_buckets(specs: Sequence, bucket_bytes: int) -> tuple[list[Slot], list[Bucket]]:
    """Assign gradients, in order, to buckets of one dtype holding about `bucket_bytes` each.

    A bucket closes once it reaches `bucket_bytes`; a gradient larger than that gets a bucket of
    its own. Offsets are padded to 64 bytes so each gradient can be wrapped as an aligned tensor.

    Example:
        >>> slots, buckets = plan_buckets([((4,), "float32"), ((2,), "float64")] * 2, 64)
        >>> [(s.bucket, s.offset) for s in slots], [b.length for b in buckets]
        ([(0, 0), (1, 0), (0, 16), (1, 8)], [20, 10])
    """
    slots, buckets, open_bucket = [], [], {}
    for index, spec in enumerate(specs):
        shape, dtype = (spec.shape, spec.dtype) if hasattr(spec, "dtype") else spec
        shape, dtype = tuple(tf.TensorShape(shape).as_list()), tf.as_dtype(dtype)
        kind = reduction_dtype(dtype)
        if kind not in open_bucket:
            open_bucket[kind] = len(buckets)
            buckets.append(Bucket(kind))
        number = open_bucket[kind]
        bucket = buckets[number]
        pad = ALIGNMENT // kind.itemsize
        offset = -(-bucket.length // pad) * pad
        slot = Slot(index, number, offset, shape, dtype)
        bucket.indices.append(index)
        bucket.length = offset + slot.size
        slots.append(slot)
        if bucket.nbytes >= bucket_bytes:
            del open_bucket[kind]
    return slots, buckets


class GradientReducer:
    """Sum or average a fixed list of gradients across `comm`, fused into few MPI calls.

    - `specs`: the gradients' `(shape, dtype)` in order (variables work too); if omitted, the
      first `reduce` call fixes them. `start` needs them up front.
    - `op`: "mean" (divide by the number of ranks) or "sum".
    - `bucket_bytes`: target bucket size; list gradients in the order they become ready so
      buckets fill, and start reducing, early.
    - `background`: reduce full buckets on a helper thread (blocking Allreduce there) instead
      of a nonblocking Iallreduce, so that they progress while the caller keeps computing.

    Returned gradients are views of the reused buckets (numpy arrays for numpy inputs, TF tensors
    for tensors, wrapped without a copy): use them before the next step. If one is still
    referenced when its bucket is next written, that bucket is reallocated rather than
    overwritten (counted in `allocations`). `mpi_calls` counts reductions issued. On a
    one-rank communicator everything is returned as given, with no MPI call.

    Example:
        reducer = GradientReducer(topo.stage_comm, specs=model.trainable_variables)
        grads = reducer.reduce(grads)                # blocking, or:
        for i in reversed(range(n)): reducer.start(i, grads[i])
        grads = reducer.finish()
    """

    def __init__(
        self,
        comm,
        specs: Sequence | None = None,
        *,
        op: str = "mean",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        background: bool = False,
    ):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.comm, self.op, self.bucket_bytes = comm, op, bucket_bytes
        self.size = comm.Get_size()
        self.mpi_calls = 0
        self.allocations = 0
        self.background = background
        self._thread = None
        self.slots: list[Slot] | None = None
        self.buckets: list[Bucket] = []
        self._buffers: list[np.ndarray] = []
        self._outputs: list[list[weakref.ref]] = []
        self._blocking = False
        self._reset_step()
        if specs is not None:
            self._plan(specs)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def reduce(self, grads: Sequence) -> list:
        """Reduce every gradient (blocking); the result has the inputs' order, shapes, dtypes."""
        if self.slots is None:
            self._plan([_spec_of(g) for g in grads])
        if len(grads) != len(self.slots):
            raise ValueError(f"expected {len(self.slots)} gradients, got {len(grads)}")
        # Nothing to overlap with here: blocking Allreduces in finish() use Open MPI's tuned
        # algorithms, which beat its nonblocking ones by 4x on 25 MiB buckets (docs/comm.md).
        self._blocking = True
        try:
            for index, grad in enumerate(grads):
                self.start(index, grad)
            return self.finish()
        finally:
            self._blocking = False

    def start(self, index: int, grad) -> None:
        """Hand over gradient `index` (None means no gradient); its bucket starts when full."""
        if self.slots is None:
            raise RuntimeError("GradientReducer needs specs (or one reduce call) before start")
        if not 0 <= index < len(self.slots) or index in self._given:
            raise ValueError(f"gradient {index} is out of range or was already started this step")
        slot = self.slots[index]
        if isinstance(grad, tf.IndexedSlices):  # e.g. an embedding's gradient: reduce it dense
            grad = tf.convert_to_tensor(grad)
        self._given[index] = grad
        if self.size == 1:
            return
        if grad is not None and tuple(grad.shape) != slot.shape:
            raise ValueError(f"gradient {index} has shape {tuple(grad.shape)}, not {slot.shape}")
        if not self._filled[slot.bucket]:
            self._prepare_bucket(slot.bucket)
        view = self._view(slot)
        if grad is None:
            view[...] = 0
        else:
            view[...] = np.asarray(grad)  # the one copy fusion needs (a view for CPU tensors)
        self._filled[slot.bucket] += 1
        if self._filled[slot.bucket] == len(self.buckets[slot.bucket].indices):
            self._launch(slot.bucket)

    def finish(self) -> list:
        """Wait for every bucket and return the reduced gradients in their original order."""
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        missing = [i for i in range(len(self.slots or [])) if i not in self._given]
        if missing:
            raise RuntimeError(f"finish() before gradients {missing} were started")
        given = self._given
        if self.size == 1:
            self._reset_step()
            return [given[i] for i in range(len(self.slots))]
        for number in self._deferred:
            self.comm.Allreduce(MPI.IN_PLACE, self._buffers[number])
        wait_all([r for r in self._requests if r is not None])
        if self._thread is not None:
            self._thread.drain()
        if self.op == "mean":
            for buffer in self._buffers:
                np.divide(buffer, self.size, out=buffer)
        results = []
        self._outputs = [[] for _ in self.buckets]
        for slot in self.slots:
            result, is_view = self._result(slot, given[slot.index])
            if is_view:  # only views pin the bucket; converted copies are independent
                self._outputs[slot.bucket].append(weakref.ref(result))
            results.append(result)
        self._reset_step()
        return results

    def reduce_flat(self, flat):
        """Reduce one contiguous gradient tensor in place, `bucket_bytes` per blocking call.

        `flat` must be memory this process alone owns: the fresh output of a compiled step
        (`hyparflow.engine.gradients.flat`), whose last piece depends on the step's data so that it
        can never be a folded constant. Its own buffer receives the sums (no copy in or out), in
        slices of `bucket_bytes`: Open MPI reduces 25 MiB slices faster than one 100 MiB call. A
        tuple or list of such tensors (a `BucketedLayout`'s buckets) is reduced bucket by
        bucket, each in place. Returns `flat` (for "mean", divided copies). On a one-rank
        communicator nothing happens. A tensor on a GPU is never handed to MPI: it is reduced
        in a host copy and the result copied back to its GPU (docs/gpu.md).
        """
        if self.size == 1:
            return flat
        if isinstance(flat, (tuple, list)):
            return type(flat)(self._reduce_flat_tensor(bucket) for bucket in flat)
        return self._reduce_flat_tensor(flat)

    def _reduce_flat_tensor(self, flat):
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        device = tensor_device(flat)
        if is_gpu_device(device):
            return self._reduce_flat_staged(flat, device)
        view = _checked_flat(np.asarray(flat))  # a CPU tensor's own memory (read-only to numpy)
        promote_tensor(view)  # Open MPI's shared-memory copies read huge pages faster
        step = max(1, self.bucket_bytes // view.itemsize)
        for start in range(0, view.size, step):
            count = min(step, view.size - start)
            # Written through its address: numpy will not hand out a writable view of it.
            address = view.ctypes.data + view.itemsize * start
            memory = MPI.buffer.fromaddress(address, view.itemsize * count)
            self.mpi_calls += 1
            self.comm.Allreduce(MPI.IN_PLACE, [memory, count, MPI.FLOAT])
        if self.op == "mean":
            return flat / self.size
        return flat

    def _reduce_flat_staged(self, flat, device: str):
        """`reduce_flat` of a GPU tensor: through a host copy (`np.asarray` of a GPU tensor is
        a copy, so reducing it in place would leave `flat` unreduced), then back to `device`."""
        host = _checked_flat(np.array(flat, copy=True))  # writable and private
        step = max(1, self.bucket_bytes // host.itemsize)
        for start in range(0, host.size, step):
            self.mpi_calls += 1
            self.comm.Allreduce(_in_place(), host[start : start + step])
        if self.op == "mean":
            host /= self.size
        with tf.device(device):
            return tf.constant(host)

    def _plan(self, specs: Sequence) -> None:
        self.slots, self.buckets = plan_buckets(specs, self.bucket_bytes)
        for slot in self.slots:
            if self.op == "mean" and not slot.dtype.is_floating:
                raise ValueError(f"gradient {slot.index} is {slot.dtype.name}: mean needs floats")
        self._buffers = [None] * len(self.buckets)  # allocated on first use
        self._outputs = [[] for _ in self.buckets]
        self._reset_step()

    def _reset_step(self) -> None:
        self._given: dict[int, object] = {}
        self._filled = [0] * len(self.buckets)
        self._requests = [None] * len(self.buckets)
        self._deferred: list[int] = []  # full buckets reduce() leaves to finish()

    def _prepare_bucket(self, number: int) -> None:
        """Before a bucket's first write this step: reuse it unless last step's results live."""
        alive = any(ref() is not None for ref in self._outputs[number])
        if self._buffers[number] is None or alive:
            bucket = self.buckets[number]
            # Zeroed: padding is reduced too, so it must be finite.
            self._buffers[number] = huge_zeros((bucket.length,), bucket.dtype)
            self.allocations += 1
        self._outputs[number] = []

    def _launch(self, number: int) -> None:
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        self.mpi_calls += 1
        if self._blocking and not self.background:
            self._deferred.append(number)
            return
        if self.background:
            # MPI only progresses a nonblocking collective inside MPI calls; a thread blocked in
            # Allreduce progresses it while the main thread computes the rest of the backward.
            self._worker().submit(number)
            return
        self._requests[number] = self.comm.Iallreduce(MPI.IN_PLACE, self._buffers[number])

    def _worker(self) -> _ReductionThread:
        if self._thread is None:
            self._thread = _ReductionThread(self.comm, self._buffers)
        self._thread.buffers = self._buffers
        return self._thread

    def close(self) -> None:
        """Stop the background reduction thread, if any."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def _view(self, slot: Slot) -> np.ndarray:
        flat = self._buffers[slot.bucket][slot.offset : slot.offset + slot.size]
        return flat.reshape(slot.shape)

    def _result(self, slot: Slot, grad) -> tuple[object, bool]:
        """The reduced gradient in `grad`'s kind and dtype, and whether it views the bucket."""
        if grad is None:
            return None, False
        view = self._view(slot)
        same_dtype = np.dtype(slot.dtype.as_numpy_dtype) == view.dtype
        if not tf.is_tensor(grad):
            return view.astype(grad.dtype, copy=False), same_dtype
        if not same_dtype:  # half precision was reduced in float32
            return tf.cast(wrap_host_buffer(view, tf.as_dtype(view.dtype)), slot.dtype), False
        return wrap_host_buffer(view, slot.dtype), True


class _ReductionThread:
    """Runs blocking in-place Allreduces of buckets, in submission order, off the main thread.

    Every rank submits buckets in the same order, so the collectives match across ranks.
    Requires MPI_THREAD_MULTIPLE (mpi4py's default), as the main thread keeps using MPI.
    """

    def __init__(self, comm, buffers):
        self.comm, self.buffers = comm, buffers
        self._queue: queue.Queue = queue.Queue()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="hyparflow-allreduce", daemon=True)
        self._thread.start()

    def submit(self, number: int) -> None:
        self._queue.put(number)

    def drain(self) -> None:
        """Wait until every submitted bucket is reduced; re-raise a failure of the thread."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

        while True:
            number = self._queue.get()
            try:
                if number is None:
                    return
                self.comm.Allreduce(MPI.IN_PLACE, self.buffers[number])
            except Exception as error:  # noqa: BLE001 - handed to the main thread in drain()
                self._error = error
            finally:
                self._queue.task_done()


def _checked_flat(view: np.ndarray) -> np.ndarray:
    if view.dtype != np.float32 or view.ndim != 1:
        raise ValueError(f"reduce_flat needs a 1-D float32 tensor, got {view.dtype} {view.shape}")
    return view


def _in_place():
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    return MPI.IN_PLACE


def _spec_of(grad):
    if grad is None:
        raise ValueError("the first reduce call cannot contain None: pass specs to the reducer")
    return tuple(grad.shape), grad.dtype
