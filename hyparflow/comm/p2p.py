"""Activations forward and gradients backward between two pipeline neighbours, without copies.

A `PipeChannel` joins this rank to one neighbour (`peer`) in a communicator. Sends go straight
from the tensor's buffer; receives land in buffers preallocated once per (direction, slot,
boundary tensor) and come back as TF tensors wrapping those buffers (DLPack, no copy).

Tag formula (documented in docs/comm.md):
    tag = (microbatch * num_tensors + tensor_index) * 2 + (1 if direction == "backward" else 0)
so two micro-batches, two boundary tensors or the two directions never share a tag within a
step; a step's tags are reused by the next step, which MPI's in-order matching keeps apart.

Variable batch size: buffers hold the largest micro-batch; a smaller one is simply a shorter
message, and the receiver reads its batch size from the received byte count (`recv` may also be
told the size it expects, and then checks it).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

from hyparflow.comm.dlpack import (
    DLPackAdapter,
    check_transport,
    default_device,
    device_empty,
    is_gpu_device,
    mpi_send_buffer,
    storage_dtype,
    synchronize_devices,
    tensor_device,
    uses_device_path,
    wrap_host_buffer,
)
from hyparflow.comm.hugepages import huge_zeros, promote_tensor

FORWARD = "forward"
BACKWARD = "backward"
DIRECTIONS = (FORWARD, BACKWARD)


@dataclass(frozen=True)
class BoundarySpec:
    """Shape (leading dimension = largest micro-batch) and dtype of one boundary tensor."""

    shape: tuple[int, ...]
    dtype: tf.DType

    @classmethod
    def of(cls, spec) -> BoundarySpec:
        """Accept a `(shape, dtype)` pair or anything with `.shape` and `.dtype`."""
        shape, dtype = (spec.shape, spec.dtype) if hasattr(spec, "dtype") else spec
        shape = tuple(tf.TensorShape(shape).as_list())
        if not shape or any(d is None for d in shape):
            raise ValueError(
                f"boundary tensor shape {shape} must be fully known and start with the largest "
                "micro-batch size, e.g. (32, 128)"
            )
        return cls(shape, tf.as_dtype(dtype))

    @property
    def max_batch(self) -> int:
        return self.shape[0]

    @functools.cached_property  # read per received message
    def row_bytes(self) -> int:
        """Bytes per sample: what one unit of batch size adds to the message."""
        return math.prod(self.shape[1:]) * self.dtype.size


def message_tag(microbatch: int, tensor_index: int, direction: str, num_tensors: int) -> int:
    """The MPI tag of one boundary tensor of one micro-batch in one direction.

    Example:
        >>> [message_tag(1, i, d, 2) for d in DIRECTIONS for i in range(2)]
        [4, 6, 5, 7]
    """
    return (microbatch * num_tensors + tensor_index) * 2 + DIRECTIONS.index(direction)


def batch_from_bytes(nbytes: int, spec: BoundarySpec) -> int:
    """Batch size of a received message of `nbytes` for `spec` (rows of `spec.row_bytes`)."""
    if spec.row_bytes == 0:
        return spec.max_batch
    batch, rest = divmod(nbytes, spec.row_bytes)
    if rest:
        raise RuntimeError(
            f"received {nbytes} bytes, not a whole number of {spec.row_bytes}-byte rows of "
            f"{spec}: sender and receiver disagree on the boundary tensor"
        )
    return batch


class SendHandle:
    """Outstanding nonblocking sends; holds the tensors until `wait` so their memory stays put."""

    def __init__(self, requests, tensors):
        self._requests = requests
        self._tensors = tensors

    def wait(self) -> None:
        """Block until every send has completed; the tensors may then be freed."""
        if self._requests:
            from mpi4py import MPI

            MPI.Request.Waitall(self._requests)
        self._requests, self._tensors = [], []

    def test(self) -> bool:
        """Whether every send has completed (releases the tensors if so); never blocks."""
        if self._requests:
            from mpi4py import MPI

            if not MPI.Request.Testall(self._requests):
                return False
        self._requests, self._tensors = [], []
        return True

    @property
    def done(self) -> bool:
        return not self._requests


class RecvHandle:
    """Posted receives of one micro-batch; `wait` returns its tensors."""

    def __init__(self, channel, microbatch, direction, requests, buffers):
        self._channel = channel
        self._microbatch = microbatch
        self._direction = direction
        self._requests = requests
        self._buffers = buffers

    def wait(self, batch_size: int | None = None) -> list[tf.Tensor]:
        """Block until the micro-batch has arrived; check `batch_size` if given."""
        from mpi4py import MPI

        statuses = [MPI.Status() for _ in self._requests]
        MPI.Request.Waitall(self._requests, statuses)
        channel = self._channel
        specs = channel.specs(self._direction)
        batches = {batch_from_bytes(s.Get_count(MPI.BYTE), sp) for s, sp in zip(statuses, specs)}
        if len(batches) != 1 or (batch_size is not None and batches != {batch_size}):
            channel._claim_slot(self._direction, self._microbatch, [])  # the slot is free again
            raise RuntimeError(
                f"micro-batch {self._microbatch} ({self._direction}) arrived with batch sizes "
                f"{sorted(batches)} but {batch_size or 'one common size'} was expected"
            )
        (batch,) = batches
        tensors = [channel._as_tensor(buf, spec, batch) for buf, spec in zip(self._buffers, specs)]
        channel._claim_slot(self._direction, self._microbatch, tensors)
        return tensors


class PipeChannel:
    """Move boundary tensors of many micro-batches to and from one pipeline neighbour.

    - `specs`: the boundary tensors as `(shape, dtype)` with the largest micro-batch first in the
      shape; `backward_specs` (default: `specs`) are those whose gradients come back.
    - `num_microbatches`: micro-batches per step (bounds the tags).
    - `num_slots`: receive buffer sets per direction; micro-batch `i` lands in slot
      `i % num_slots`, whose buffers are reused once the tensors last received there are gone.
      While such a tensor is still referenced, the slot gets fresh buffers instead (counted in
      `allocations`), so a live tensor is never overwritten. Default `num_microbatches`; the
      stage's peak in-flight count (`schedule.peak_in_flight`) is enough for steady reuse.
    - `transport`: "auto" (GPU tensors via DLPack for CUDA-aware MPI, host memory otherwise),
      "host" or "device" to force one. Receives land on `device` (default: TF's default device).

    Example (stage 0 of 2, sending micro-batch 3 and receiving its gradient):
        channel = PipeChannel(topo.pipeline_comm, topo.next_rank, [((8, 16), "float32")], 4)
        handle = channel.isend([activation], 3, "forward")
        (grad,) = channel.recv(3, "backward")
        handle.wait()
    """

    def __init__(
        self,
        comm,
        peer: int,
        specs: Sequence,
        num_microbatches: int,
        *,
        backward_specs: Sequence | None = None,
        num_slots: int | None = None,
        transport: str = "auto",
        device: str | None = None,
    ):
        from mpi4py import MPI

        if peer is None or not 0 <= peer < comm.Get_size() or peer == comm.Get_rank():
            raise ValueError(f"peer {peer} is not another rank of this {comm.Get_size()}-rank comm")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.comm, self.peer, self.num_microbatches = comm, peer, num_microbatches
        self._specs = {
            FORWARD: [BoundarySpec.of(s) for s in specs],
            BACKWARD: [
                BoundarySpec.of(s) for s in (specs if backward_specs is None else backward_specs)
            ],
        }
        self.num_tensors = max(1, *(len(s) for s in self._specs.values()))
        largest = message_tag(
            num_microbatches - 1, self.num_tensors - 1, BACKWARD, self.num_tensors
        )
        # TAG_UB is attached to COMM_WORLD only; it holds for every communicator.
        tag_ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if largest > tag_ub:
            raise ValueError(
                f"{num_microbatches} micro-batches x {self.num_tensors} boundary tensors need tag "
                f"{largest}, above this MPI's TAG_UB {tag_ub}: use fewer micro-batches per step"
            )
        self.num_slots = num_microbatches if num_slots is None else num_slots
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.transport = check_transport(transport)
        self.device = device or default_device()
        self.receives_on_device = uses_device_path(self.device, transport)
        self._buffers: dict[tuple[str, int], list] = {}  # allocated on first use, then reused
        self._slot_owner: dict[tuple[str, int], tuple[int, list[weakref.ref]]] = {}
        self._pending: list[SendHandle] = []
        self.allocations = 0  # receive-buffer sets allocated (steady state: no growth)

    def specs(self, direction: str) -> list[BoundarySpec]:
        """The boundary tensors travelling in `direction`."""
        _check_direction(direction)
        return self._specs[direction]

    def isend(self, tensors: Sequence, microbatch: int, direction: str) -> SendHandle:
        """Start sending `tensors` of `microbatch`; they must stay untouched until `wait`."""
        specs = self._check_message(microbatch, direction)
        if len(tensors) != len(specs):
            raise ValueError(f"expected {len(specs)} {direction} tensors, got {len(tensors)}")
        device_path = [uses_device_path(tensor_device(t), self.transport) for t in tensors]
        sizes = [_check_tensor(tensor, spec, direction) for tensor, spec in zip(tensors, specs)]
        if any(on and is_gpu_device(tensor_device(t)) for on, t in zip(device_path, tensors)):
            synchronize_devices()  # the producing kernels must have written the buffers
        for tensor, on_device, nbytes in zip(tensors, device_path, sizes):
            if not on_device:
                promote_tensor(tensor, nbytes)  # the receiver's copy reads huge pages faster
        requests = [
            self.comm.Isend(
                mpi_send_buffer(tensor, on_device),
                dest=self.peer,
                tag=message_tag(microbatch, index, direction, self.num_tensors),
            )
            for index, (tensor, on_device) in enumerate(zip(tensors, device_path))
        ]
        handle = SendHandle(requests, list(tensors))
        self._pending = [h for h in self._pending if not h.done] + [handle]
        return handle

    def irecv(self, microbatch: int, direction: str) -> RecvHandle:
        """Post the receives of `microbatch` into its slot's buffers; `wait` returns tensors."""
        from mpi4py import MPI

        self._check_message(microbatch, direction)
        buffers = self._post(direction, microbatch)
        if self.receives_on_device and is_gpu_device(self.device):
            synchronize_devices()  # kernels reading the slot's last contents must be done
        requests = [
            self.comm.Irecv(
                [DLPackAdapter(buf) if self.receives_on_device else buf, MPI.BYTE],
                source=self.peer,
                tag=message_tag(microbatch, index, direction, self.num_tensors),
            )
            for index, buf in enumerate(buffers)
        ]
        return RecvHandle(self, microbatch, direction, requests, buffers)

    def recv(self, microbatch: int, direction: str, batch_size: int | None = None) -> list:
        """Receive `microbatch`'s tensors (blocking), zero-copy views of the slot's buffers.

        The batch size is read from the message length; pass `batch_size` to have it checked.
        """
        return self.irecv(microbatch, direction).wait(batch_size)

    def wait_sends(self) -> None:
        """Complete every send started on this channel (e.g. at the end of a step)."""
        for handle in self._pending:
            handle.wait()
        self._pending = []

    def receive_buffer(self, microbatch: int, direction: str, index: int):
        """The buffer that `microbatch`'s tensor `index` last landed in (tests, inspection)."""
        return self._buffers[direction, microbatch % self.num_slots][index]

    def close(self) -> None:
        """Finish pending sends and drop the receive buffers."""
        self.wait_sends()
        self._buffers.clear()
        self._slot_owner.clear()

    def _check_message(self, microbatch: int, direction: str) -> list[BoundarySpec]:
        _check_direction(direction)
        if not 0 <= microbatch < self.num_microbatches:
            raise ValueError(
                f"micro-batch {microbatch} is outside this channel's 0..{self.num_microbatches - 1}"
            )
        return self._specs[direction]

    def _slot_buffers(self, direction: str, slot: int) -> list:
        """The slot's buffers: reused, unless a tensor still wraps them (then fresh ones)."""
        key = (direction, slot)
        owner = self._slot_owner.get(key)
        in_use = owner is not None and any(ref() is not None for ref in owner[1])
        if key not in self._buffers or in_use:
            # A live tensor keeps its old buffer alive (DLPack holds a reference), so replacing
            # the slot's buffer never invalidates it; `allocations` shows when this happens.
            self.allocations += 1
            self._buffers[key] = [self._allocate(spec) for spec in self._specs[direction]]
        return self._buffers[key]

    def _allocate(self, spec: BoundarySpec):
        if self.receives_on_device:
            return device_empty(spec.shape, spec.dtype, self.device)
        return huge_zeros(spec.shape, storage_dtype(spec.dtype))

    def _post(self, direction: str, microbatch: int) -> list:
        """Mark the slot as receiving and return its buffers; refuse a slot already receiving."""
        key = (direction, microbatch % self.num_slots)
        owner = self._slot_owner.get(key)
        if owner is not None and owner[1] is None:
            raise RuntimeError(
                f"receiving {direction} micro-batch {microbatch} while micro-batch {owner[0]} is "
                f"still being received into the same slot: wait for it first, or give the "
                f"channel more than num_slots={self.num_slots}"
            )
        buffers = self._slot_buffers(*key)
        self._slot_owner[key] = (microbatch, None)
        return buffers

    def _claim_slot(self, direction: str, microbatch: int, tensors: list) -> None:
        refs = [weakref.ref(t) for t in tensors]
        self._slot_owner[direction, microbatch % self.num_slots] = (microbatch, refs)

    def _as_tensor(self, buffer, spec: BoundarySpec, batch: int) -> tf.Tensor:
        if self.receives_on_device:
            # A new handle on the same memory (Identity forwards its input), so the returned
            # tensor's lifetime can be tracked apart from the channel's own reference.
            full = tf.identity(buffer)
            return full if batch == spec.max_batch else full[:batch]
        return wrap_host_buffer(buffer[:batch], spec.dtype)


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be {FORWARD!r} or {BACKWARD!r}, got {direction!r}")


def _check_tensor(tensor, spec: BoundarySpec, direction: str) -> int:
    """Raise unless `tensor` fits `spec`; return its byte count."""
    shape, dtype = tuple(tensor.shape), tf.as_dtype(tensor.dtype)
    if dtype != spec.dtype or shape[1:] != spec.shape[1:] or not 0 <= shape[0] <= spec.max_batch:
        raise ValueError(
            f"{direction} tensor of shape {shape} and dtype {dtype.name} does not fit the "
            f"boundary spec {spec.shape} {spec.dtype.name} (batch may only be smaller)"
        )
    return shape[0] * spec.row_bytes
