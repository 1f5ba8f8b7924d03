"""Activations forward and gradients backward between two pipeline neighbours, without copies.

A `PipeChannel` joins this rank to one neighbour (`peer`) in a communicator. Sends go straight
from the tensor's buffer; receives land in buffers preallocated once per (direction, slot,
boundary tensor) and come back as TF tensors wrapping those buffers (DLPack, no copy). Tags and
specs: `comm/boundary.py`.

Variable batch size: buffers hold the largest micro-batch; a smaller one is simply a shorter
message, and the receiver reads its batch size from the received byte count (`recv` may also be
told the size it expects, and then checks it).

Unknown dimensions: a dynamic tensor sends its shape header before its data (`irecv` posts
header receives at once and data receives only once the header says how much room they need).
Dynamic receive buffers are flat and grow on demand; static specs send no header.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from hyparflow.comm import cuda_aware as cuda_awareness
from hyparflow.comm.boundary import (
    BACKWARD,
    DIRECTIONS,
    FORWARD,
    BoundarySpec,
    batch_from_bytes,
    check_direction,
    check_tensor,
    header_tag,
    message_tag,
    shape_from_header,
)
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
    to_device,
    uses_device_path,
    wrap_host_buffer,
)
from hyparflow.comm.failure import wait_all
from hyparflow.comm.hugepages import huge_zeros, promote_tensor

__all__ = [
    "BACKWARD",
    "DIRECTIONS",
    "FORWARD",
    "BoundarySpec",
    "PipeChannel",
    "RecvHandle",
    "SendHandle",
    "batch_from_bytes",
    "header_tag",
    "message_tag",
    "shape_from_header",
]


def _mpi():
    # mpi4py's import starts MPI: deferred so that importing hyparflow never starts it.
    from mpi4py import MPI

    return MPI


# The boundary module's examples, run with this module's doctests (tests/test_comm.py).
__test__ = {
    "BoundarySpec.of": BoundarySpec.of,
    "BoundarySpec.fits": BoundarySpec.fits,
    "message_tag": message_tag,
    "header_tag": header_tag,
    "shape_from_header": shape_from_header,
}


class SendHandle:
    """Outstanding nonblocking sends; holds the tensors until `wait` so their memory stays put."""

    def __init__(self, requests, tensors):
        self._requests = requests
        self._tensors = tensors  # and the shape headers of dynamic tensors

    def wait(self) -> None:
        """Block until every send has completed; the tensors may then be freed."""
        if self._requests:
            wait_all(self._requests)
        self._requests, self._tensors = [], []

    def test(self) -> bool:
        """Whether every send has completed (releases the tensors if so); never blocks."""
        if self._requests:
            MPI = _mpi()
            if not MPI.Request.Testall(self._requests):
                return False
        self._requests, self._tensors = [], []
        return True

    @property
    def done(self) -> bool:
        return not self._requests


class RecvHandle:
    """Posted receives of one micro-batch; `wait` returns its tensors.

    `requests` holds one receive per tensor: its data (static specs) or its shape header
    (dynamic specs, `headers[i]` the header's array; None for static ones).
    """

    def __init__(self, channel, microbatch, direction, requests, headers):
        self._channel = channel
        self._microbatch = microbatch
        self._direction = direction
        self._requests = requests
        self._headers = headers

    def wait(self, batch_size: int | None = None) -> list[tf.Tensor]:
        """Block until the micro-batch has arrived; check `batch_size` if given."""
        MPI = _mpi()
        statuses = [MPI.Status() for _ in self._requests]
        wait_all(self._requests, statuses)
        channel, direction, microbatch = self._channel, self._direction, self._microbatch
        specs = channel.specs(direction)
        try:
            shapes = [
                (batch_from_bytes(s.Get_count(MPI.BYTE), spec), *spec.shape[1:])
                if header is None
                else shape_from_header(header, s.Get_count(MPI.INT64_T), spec)
                for s, header, spec in zip(statuses, self._headers, specs, strict=True)
            ]
            # Dynamic data is received even when the batch sizes disagree, so that no message
            # is left behind to be matched by a later receive.
            buffers = channel.receive_dynamic(direction, microbatch, shapes)
        except BaseException:
            channel.claim_slot(direction, microbatch, [])  # the slot is free again
            raise
        batches = {shape[0] for shape in shapes}
        if len(batches) != 1 or (batch_size is not None and batches != {batch_size}):
            channel.claim_slot(direction, microbatch, [])
            raise RuntimeError(
                f"micro-batch {microbatch} ({direction}) arrived with batch sizes "
                f"{sorted(batches)} but {batch_size or 'one common size'} was expected"
            )
        tensors = [
            channel.as_tensor(buf, spec, shape)
            for buf, spec, shape in zip(buffers, specs, shapes, strict=True)
        ]
        channel.claim_slot(direction, microbatch, tensors)
        return tensors


class PipeChannel:
    """Move boundary tensors of many micro-batches to and from one pipeline neighbour.

    - `specs`: the boundary tensors as `(shape, dtype)` with the largest micro-batch first in the
      shape; later dimensions may be None (e.g. a sequence length that varies per batch): such
      tensors send a small shape header before their data. `backward_specs` (default: `specs`)
      are those whose gradients come back.
    - `num_microbatches`: micro-batches per step (bounds the tags).
    - `num_slots`: receive buffer sets per direction; micro-batch `i` lands in slot
      `i % num_slots`, whose buffers are reused once the tensors last received there are gone.
      While such a tensor is still referenced, the slot gets fresh buffers instead (counted in
      `allocations`), so a live tensor is never overwritten. Default `num_microbatches`; the
      stage's peak in-flight count (`schedule.peak_in_flight`) is enough for steady reuse.
      Buffers of dynamic tensors grow when a message needs more room (also counted).
    - `transport`: "auto" (GPU tensors via DLPack if MPI is CUDA-aware, else staged through
      host memory), "host" or "device" to force one (`dlpack.uses_device_path`; "device" on a
      GPU is refused unless MPI is CUDA-aware). `cuda_aware`: a `CudaAwareness` or bool, or
      None for `cuda_aware.detect()`. Receives land on `device` (default: TF's default device).

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
        cuda_aware=None,
    ):
        MPI = _mpi()
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
        self.dynamic = any(s.dynamic for specs in self._specs.values() for s in specs)
        last = (num_microbatches - 1, self.num_tensors - 1, BACKWARD, self.num_tensors)
        largest = header_tag(*last, num_microbatches) if self.dynamic else message_tag(*last)
        # TAG_UB is attached to COMM_WORLD only; it holds for every communicator.
        tag_ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if largest > tag_ub:
            raise ValueError(
                f"{num_microbatches} micro-batches x {self.num_tensors} boundary tensors need tag "
                f"{largest}{' (shape headers included)' if self.dynamic else ''}, above this "
                f"MPI's TAG_UB {tag_ub}: use fewer micro-batches per step"
            )
        self.num_slots = num_microbatches if num_slots is None else num_slots
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.transport = check_transport(transport)
        self.device, self.cuda_aware = device or default_device(), cuda_aware
        self.receives_on_device = uses_device_path(self.device, transport, cuda_aware)
        # A GPU's receives off the device path land in host buffers, then go to the GPU.
        self.stages_receives = is_gpu_device(self.device) and not self.receives_on_device
        if self.stages_receives:
            self._warn_staging()
        # Allocated on first use, then reused; a dynamic tensor's entry is a flat buffer (None
        # until its first message says how large it must be).
        self._buffers: dict[tuple[str, int], list] = {}
        self._slot_owner: dict[tuple[str, int], tuple[int, list[weakref.ref]]] = {}
        self._pending: list[SendHandle] = []
        self.allocations = 0  # receive-buffer sets allocated or grown (steady state: no growth)

    def specs(self, direction: str) -> list[BoundarySpec]:
        """The boundary tensors travelling in `direction`."""
        check_direction(direction)
        return self._specs[direction]

    def isend(self, tensors: Sequence, microbatch: int, direction: str) -> SendHandle:
        """Start sending `tensors` of `microbatch`; they must stay untouched until `wait`."""
        MPI = _mpi()
        specs = self._check_message(microbatch, direction)
        if len(tensors) != len(specs):
            raise ValueError(f"expected {len(specs)} {direction} tensors, got {len(tensors)}")
        devices = [tensor_device(t) for t in tensors]
        on_gpu = [is_gpu_device(d) for d in devices]
        device_path = [uses_device_path(d, self.transport, self.cuda_aware) for d in devices]
        sizes = [
            check_tensor(tensor, spec, direction)
            for tensor, spec in zip(tensors, specs, strict=True)
        ]
        if any(on and gpu for on, gpu in zip(device_path, on_gpu, strict=True)):
            synchronize_devices()  # the producing kernels must have written the buffers
        elif any(on_gpu):
            self._warn_staging()  # GPU tensors off the device path: staged into host copies
        for tensor, on_device, gpu, nbytes in zip(tensors, device_path, on_gpu, sizes, strict=True):
            if not on_device and not gpu:
                promote_tensor(tensor, nbytes)  # the receiver's copy reads huge pages faster
        requests, keep = [], list(tensors)
        for index, (tensor, spec, on_device, gpu) in enumerate(
            zip(tensors, specs, device_path, on_gpu, strict=True)
        ):
            if spec.dynamic:
                header = np.array(tuple(tensor.shape), dtype=np.int64)
                keep.append(header)  # MPI reads it until the send completes
                tag = self._header_tag(microbatch, index, direction)
                requests.append(self.comm.Isend([header, MPI.INT64_T], dest=self.peer, tag=tag))
            message = mpi_send_buffer(tensor, on_device, gpu)
            keep.append(message[0])  # a staged host copy must outlive the send too
            tag = message_tag(microbatch, index, direction, self.num_tensors)
            requests.append(self.comm.Isend(message, dest=self.peer, tag=tag))
        handle = SendHandle(requests, keep)
        self._pending = [h for h in self._pending if not h.done] + [handle]
        return handle

    def irecv(self, microbatch: int, direction: str) -> RecvHandle:
        """Post the receives of `microbatch` (data, or shape headers of dynamic tensors) into
        its slot; `wait` receives the rest and returns tensors."""
        MPI = _mpi()
        specs = self._check_message(microbatch, direction)
        buffers = self._post(direction, microbatch)
        if is_gpu_device(self.device):  # device path or staged: kernels (or host-to-device
            synchronize_devices()  # copies) reading the slot's last contents must be done
        requests, headers = [], []
        for index, (spec, buf) in enumerate(zip(specs, buffers, strict=True)):
            if spec.dynamic:
                header = np.empty(len(spec.shape), np.int64)
                tag = self._header_tag(microbatch, index, direction)
                message = [header, MPI.INT64_T]
            else:
                header, tag = None, message_tag(microbatch, index, direction, self.num_tensors)
                message = [DLPackAdapter(buf) if self.receives_on_device else buf, MPI.BYTE]
            headers.append(header)
            requests.append(self.comm.Irecv(message, source=self.peer, tag=tag))
        return RecvHandle(self, microbatch, direction, requests, headers)

    def recv(self, microbatch: int, direction: str, batch_size: int | None = None) -> list:
        """Receive `microbatch`'s tensors (blocking), zero-copy views of the slot's buffers.

        The batch size is read from the message length (or a dynamic tensor's shape header);
        pass `batch_size` to have it checked.
        """
        return self.irecv(microbatch, direction).wait(batch_size)

    def wait_sends(self) -> None:
        """Complete every send started on this channel (e.g. at the end of a step)."""
        for handle in self._pending:
            handle.wait()
        self._pending = []

    def receive_buffer(self, microbatch: int, direction: str, index: int):
        """The buffer that `microbatch`'s tensor `index` last landed in (tests, inspection).

        A dynamic tensor's buffer is flat; the tensor views a prefix of it.
        """
        return self._buffers[direction, microbatch % self.num_slots][index]

    def close(self) -> None:
        """Finish pending sends and drop the receive buffers."""
        self.wait_sends()
        self._buffers.clear()
        self._slot_owner.clear()

    def _check_message(self, microbatch: int, direction: str) -> list[BoundarySpec]:
        check_direction(direction)
        if not 0 <= microbatch < self.num_microbatches:
            raise ValueError(
                f"micro-batch {microbatch} is outside this channel's 0..{self.num_microbatches - 1}"
            )
        return self._specs[direction]

    def _header_tag(self, microbatch: int, index: int, direction: str) -> int:
        return header_tag(microbatch, index, direction, self.num_tensors, self.num_microbatches)

    def _slot_buffers(self, direction: str, slot: int) -> list:
        """The slot's buffers: reused, unless a tensor still wraps them (then fresh ones)."""
        key = (direction, slot)
        owner = self._slot_owner.get(key)
        in_use = owner is not None and any(ref() is not None for ref in owner[1])
        if key not in self._buffers or in_use:
            # A live tensor keeps its old buffer alive (DLPack holds a reference), so replacing
            # the slot's buffer never invalidates it; `allocations` shows when this happens.
            self.allocations += 1
            self._buffers[key] = [
                None if spec.dynamic else self._allocate(spec.shape, spec.dtype)
                for spec in self._specs[direction]
            ]
        return self._buffers[key]

    def _allocate(self, shape, dtype: tf.DType):
        if self.receives_on_device:
            return device_empty(shape, dtype, self.device)
        return huge_zeros(shape, storage_dtype(dtype))

    def receive_dynamic(self, direction: str, microbatch: int, shapes: list) -> list:
        """Receive the dynamic tensors' data (shapes known from their headers) into the slot's
        buffers, growing those too small; return the slot's buffers."""
        MPI = _mpi()
        specs = self._specs[direction]
        buffers = self._buffers[direction, microbatch % self.num_slots]
        requests, expected, grown = [], [], False
        for index, (spec, shape) in enumerate(zip(specs, shapes, strict=True)):
            if not spec.dynamic:
                continue
            count = math.prod(shape)
            # Room for a full micro-batch of these rows: a smaller last micro-batch followed by
            # a full one of the same length then needs no second allocation.
            room = spec.max_batch * math.prod(shape[1:])
            buf = buffers[index]
            if buf is None or math.prod(buf.shape) < room:
                # Only a buffer no live tensor wraps gets here (`_slot_buffers` made sure).
                grown |= buf is not None
                buf = buffers[index] = self._allocate((room,), spec.dtype)
            # The host path receives into exactly the announced size, so a longer message is
            # an MPI truncation error rather than silently accepted.
            into = DLPackAdapter(buf) if self.receives_on_device else buf[:count]
            tag = message_tag(microbatch, index, direction, self.num_tensors)
            requests.append(self.comm.Irecv([into, MPI.BYTE], source=self.peer, tag=tag))
            expected.append((count * spec.dtype.size, spec, shape))
        self.allocations += grown
        if requests:
            statuses = [MPI.Status() for _ in requests]
            wait_all(requests, statuses)
            for status, (nbytes, spec, shape) in zip(statuses, expected, strict=True):
                if status.Get_count(MPI.BYTE) != nbytes:
                    raise RuntimeError(
                        f"received {status.Get_count(MPI.BYTE)} bytes for a {list(shape)} "
                        f"tensor of {spec} ({nbytes} expected): sender and receiver disagree "
                        "on the boundary tensor"
                    )
        return buffers

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

    def claim_slot(self, direction: str, microbatch: int, tensors: list) -> None:
        refs = [weakref.ref(t) for t in tensors]
        self._slot_owner[direction, microbatch % self.num_slots] = (microbatch, refs)

    def as_tensor(self, buffer, spec: BoundarySpec, shape: tuple[int, ...]) -> tf.Tensor:
        batch = shape[0]
        if spec.dynamic:
            count = math.prod(shape)
            if self.receives_on_device:
                full = tf.identity(buffer)  # its own handle, as below
                return tf.reshape(full if count == math.prod(buffer.shape) else full[:count], shape)
            # A prefix of the flat buffer starts where the buffer does: aligned, contiguous.
            return self._placed(wrap_host_buffer(buffer[:count].reshape(shape), spec.dtype))
        if self.receives_on_device:
            # A new handle on the same memory (Identity forwards its input), so the returned
            # tensor's lifetime can be tracked apart from the channel's own reference.
            full = tf.identity(buffer)
            return full if batch == spec.max_batch else full[:batch]
        return self._placed(wrap_host_buffer(buffer[:batch], spec.dtype))

    def _placed(self, tensor: tf.Tensor) -> tf.Tensor:
        """A host-received tensor, copied to the GPU when this channel stages receives."""
        return to_device(tensor, self.device) if self.stages_receives else tensor

    def _warn_staging(self) -> None:
        if self.transport == "auto":  # "host" was the caller's own choice: nothing to say
            answer = cuda_awareness.resolve(self.cuda_aware)
            cuda_awareness.warn_staging(answer, _mpi().COMM_WORLD.Get_rank())
