"""Zero-copy bridges between TF tensors, numpy buffers and MPI (host and DLPack device paths).

Facts this relies on (DESIGN.md section 4): MPI can send straight from a CPU eager tensor
(read-only buffer protocol); `from_dlpack(ndarray.__dlpack__())` wraps a numpy buffer without a
copy; mpi4py 4.1 rejects TF's own `__dlpack__` (it asks for `max_version` and TF returns an
unversioned capsule), so device tensors go through `DLPackAdapter`, whose `__dlpack__` takes no
`max_version`.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

# TF's CPU allocator aligns to 64 bytes and Eigen kernels may assume it: match it.
ALIGNMENT = 64


class DLPackAdapter:
    """Expose a TF tensor to mpi4py through DLPack (how CUDA-aware MPI reaches GPU memory).

    Example:
        comm.Isend([DLPackAdapter(gpu_tensor), MPI.BYTE], dest=1, tag=0)
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, stream=None):
        # No max_version: mpi4py then falls back to the unversioned capsule TF produces.
        return tf.experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@functools.lru_cache(maxsize=64)  # asked per message; a process has few device strings
def is_gpu_device(device: str | None) -> bool:
    """Whether a TF device string (e.g. ".../device:GPU:0") names a GPU.

    Example:
        >>> is_gpu_device("/job:localhost/replica:0/task:0/device:GPU:1"), is_gpu_device("/CPU:0")
        (True, False)
    """
    if not device:
        return False
    return tf.DeviceSpec.from_string(device).device_type in ("GPU", "gpu")


def default_device() -> str:
    """Where TF places new tensors by default: the first GPU if there is one, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "/CPU:0"


def mpi_send_buffer(tensor, use_device_path: bool):
    """An mpi4py message for `tensor`'s raw bytes, with no copy on either path.

    Raw bytes (`MPI.BYTE`) carry every dtype, including bfloat16, which has no MPI datatype.
    Numpy arrays and CPU tensors use the buffer protocol; GPU tensors need `use_device_path`.
    """
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    source = DLPackAdapter(tensor) if use_device_path else tensor
    return [source, MPI.BYTE]


TRANSPORTS = ("auto", "host", "device")


def check_transport(transport: str) -> str:
    """Return `transport` if it names a transport, else raise a ValueError saying which exist."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def tensor_device(value) -> str | None:
    """The TF device string of `value`, or None for host objects such as numpy arrays."""
    return value.device if tf.is_tensor(value) else None


def uses_device_path(device: str | None, transport: str) -> bool:
    """Pick how MPI reaches memory on `device`: DLPack adapter (True) or buffer protocol (False).

    With transport "auto", GPU memory takes the device path (CUDA-aware MPI reads it in place)
    and host memory the buffer protocol; "host" and "device" force one (forcing "device" on CPU
    exercises the GPU code path without a GPU). Host objects (`device` None) always use "host".

    Example:
        >>> uses_device_path("/job:localhost/replica:0/task:0/device:GPU:0", "auto")
        True
        >>> uses_device_path("/device:CPU:0", "auto"), uses_device_path("/device:GPU:0", "host")
        (False, False)
    """
    if check_transport(transport) == "host" or device is None:
        return False
    return transport == "device" or is_gpu_device(device)


def storage_dtype(dtype: tf.DType) -> np.dtype:
    """The numpy dtype of a host receive buffer for `dtype` (numpy cannot export bfloat16)."""
    dtype = tf.as_dtype(dtype)
    return np.dtype(np.uint16) if dtype == tf.bfloat16 else np.dtype(dtype.as_numpy_dtype)


def aligned_empty(shape, dtype, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialized C-contiguous numpy array whose data starts on an `alignment` boundary.

    Example:
        >>> aligned_empty((3, 5), np.float32).ctypes.data % 64
        0
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def wrap_host_buffer(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """A TF tensor of `dtype` that *is* `array`'s memory: later writes to `array` show through.

    `array` must start on a 64-byte boundary (`aligned_empty`): TF imports an unaligned buffer
    but later aborts the whole process ("Check failed: IsAligned()") when a kernel maps it.

    Example:
        >>> buf = aligned_empty((2,), np.float32); t = wrap_host_buffer(buf, tf.float32)
        >>> buf[0] = 7; float(t[0])
        7.0
    """
    if array.size and array.ctypes.data % ALIGNMENT:
        raise ValueError(
            f"buffer at {array.ctypes.data:#x} is not {ALIGNMENT}-byte aligned; TF would abort "
            "on it: allocate receive buffers with aligned_empty"
        )
    tensor = tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    dtype = tf.as_dtype(dtype)
    if tensor.dtype != dtype:
        # bfloat16 travels as uint16 bits; Bitcast forwards the buffer without copying.
        tensor = tf.bitcast(tensor, dtype)
    return tensor


def device_empty(shape, dtype: tf.DType, device: str) -> tf.Tensor:
    """A fresh, uninitialized TF tensor on `device` for MPI to write into through DLPack.

    `Empty` never shares storage with another tensor (unlike cached constants), and with
    `init=False` it queues no kernel that could race with MPI's write.
    """
    with tf.device(device):
        return tf.raw_ops.Empty(shape=list(shape), dtype=tf.as_dtype(dtype), init=False)


def synchronize_devices() -> None:
    """Wait until every queued TF kernel has finished, so MPI sees (and may reuse) GPU memory.

    TF runs GPU kernels asynchronously; without this MPI could send a buffer not yet written or
    overwrite one a kernel is still reading.
    """
    tf.test.experimental.sync_devices()
