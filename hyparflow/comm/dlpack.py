"""Zero-copy bridges between TF tensors, numpy buffers and MPI (host and DLPack device paths).

Facts this relies on (docs/comm.md: "Send", "Receive", "GPU path"): MPI can send straight from
a CPU eager tensor (read-only buffer protocol); `from_dlpack(ndarray.__dlpack__())` wraps a
numpy buffer without a copy; mpi4py 4.1 rejects TF's own `__dlpack__` (it asks for
`max_version` and TF returns an unversioned capsule), so device tensors go through
`DLPackAdapter`, whose `__dlpack__` takes no `max_version`. GPU memory reaches MPI only when
MPI is CUDA-aware (`comm/cuda_aware.py`); otherwise GPU tensors are staged through host copies
(docs/gpu.md).
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from hyparflow.comm import cuda_aware as cuda_aware_module

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


def mpi_send_buffer(tensor, use_device_path: bool, on_gpu: bool | None = None):
    """An mpi4py message for `tensor`'s raw bytes: no copy, except a GPU tensor off the device
    path, which is staged into a host copy (`host_copy`) rather than ever handed to MPI.

    Raw bytes (`MPI.BYTE`) carry every dtype, including bfloat16, which has no MPI datatype.
    Numpy arrays and CPU tensors use the buffer protocol. `on_gpu` (default: asked of the
    tensor) says whether `tensor` lives on a GPU. Keep the message alive until the send ends.
    """
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    if use_device_path:
        return [DLPackAdapter(tensor), MPI.BYTE]
    if on_gpu is None:
        on_gpu = is_gpu_device(tensor_device(tensor))
    return [host_copy(tensor) if on_gpu else tensor, MPI.BYTE]


def host_copy(tensor) -> np.ndarray:
    """A host copy of `tensor`'s bytes (flat uint8): how a GPU tensor reaches an MPI that is not
    CUDA-aware. TF copies device memory to host, waiting for the kernels that write it."""
    return np.ascontiguousarray(np.asarray(tensor)).reshape(-1).view(np.uint8)


def to_device(tensor, device: str) -> tf.Tensor:
    """`tensor` (received into host memory) copied onto `device`, e.g. a GPU."""
    with tf.device(device):
        return tf.identity(tensor)


TRANSPORTS = ("auto", "host", "device")


def check_transport(transport: str) -> str:
    """Return `transport` if it names a transport, else raise a ValueError saying which exist."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def tensor_device(value) -> str | None:
    """The TF device string of `value`, or None for host objects such as numpy arrays."""
    return value.device if tf.is_tensor(value) else None


def uses_device_path(device: str | None, transport: str, cuda_aware=None) -> bool:
    """Pick how MPI reaches memory on `device`: DLPack adapter (True) or host memory (False).

    GPU memory is handed to MPI only when MPI is CUDA-aware (`cuda_aware`: a
    `CudaAwareness`, a bool, or None to ask `cuda_aware.detect()`, which is asked only for GPU
    devices). With transport "auto" a GPU takes the device path if so, else its tensors are
    staged through host memory; "host" always stages. "device" forces the adapter: on CPU it
    exercises the GPU code path without a GPU; on a GPU with an MPI that is not CUDA-aware it
    is refused (a RuntimeError, before any MPI call) rather than crash inside MPI. Host
    objects (`device` None) always use the buffer protocol.

    Example:
        >>> gpu = "/job:localhost/replica:0/task:0/device:GPU:0"
        >>> uses_device_path(gpu, "auto", True), uses_device_path(gpu, "auto", False)
        (True, False)
        >>> uses_device_path("/device:CPU:0", "auto"), uses_device_path("/device:CPU:0", "device")
        (False, True)
    """
    if check_transport(transport) == "host" or device is None:
        return False
    if not is_gpu_device(device):
        return transport == "device"
    answer = cuda_aware_module.resolve(cuda_aware)
    if answer.aware:
        return True
    if transport == "device":
        raise RuntimeError(
            f"transport='device' would hand GPU memory on {device} to MPI, which is not "
            f"CUDA-aware as far as hyparflow can tell ({answer.reason}); MPI would crash. Use "
            f"transport='auto' or 'host' (GPU tensors then go through host memory), or set "
            f"{cuda_aware_module.OVERRIDE}=1 if this MPI library is CUDA-aware (docs/gpu.md)."
        )
    return False


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
