"""Boundary tensors between pipeline stages: their specs, MPI tags and dynamic shape headers.

Tag formula (documented in docs/comm.md):
    tag = (microbatch * num_tensors + tensor_index) * 2 + (1 if direction == "backward" else 0)
so two micro-batches, two boundary tensors or the two directions never share a tag within a
step; a step's tags are reused by the next step, which MPI's in-order matching keeps apart.

A spec may leave non-batch dimensions None (e.g. `(8, None, 32)` for a transformer's hidden
states). Such a "dynamic" tensor travels as two messages: a shape header (int64, one entry per
dimension), then the data. Headers have their own tag space above every data tag,
`header tag = data tag + 2 * num_microbatches * num_tensors`, so a header and a data message can
never match each other's receive, whatever order receives are posted in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

FORWARD = "forward"
BACKWARD = "backward"
DIRECTIONS = (FORWARD, BACKWARD)


@dataclass(frozen=True)
class BoundarySpec:
    """Shape (leading dimension = largest micro-batch, later ones may be None) and dtype of one
    boundary tensor."""

    shape: tuple[int | None, ...]
    dtype: tf.DType

    @classmethod
    def of(cls, spec) -> BoundarySpec:
        """Accept a `(shape, dtype)` pair or anything with `.shape` and `.dtype`.

        Example:
            >>> BoundarySpec.of(((8, None, 32), "float32")).dynamic
            True
        """
        shape, dtype = (spec.shape, spec.dtype) if hasattr(spec, "dtype") else spec
        shape = tuple(tf.TensorShape(shape).as_list())
        if not shape or shape[0] is None:
            raise ValueError(
                f"boundary tensor shape {shape} must start with a known batch size, the largest "
                "micro-batch's, e.g. (32, 128) or (32, None, 64): only later dimensions may be None"
            )
        return cls(shape, tf.as_dtype(dtype))

    @property
    def max_batch(self) -> int:
        return self.shape[0]

    @functools.cached_property  # read per message
    def dynamic(self) -> bool:
        """Whether a non-batch dimension is unknown: each message then carries its shape."""
        return None in self.shape[1:]

    @functools.cached_property  # read per received message
    def row_bytes(self) -> int:
        """Bytes per sample: what one unit of batch size adds to the message (static specs)."""
        if self.dynamic:
            raise ValueError(
                f"boundary spec {self.shape} has unknown dimensions, so its bytes per sample "
                "vary per message: use the received tensor's shape instead"
            )
        return math.prod(self.shape[1:]) * self.dtype.size

    def fits(self, shape) -> bool:
        """Whether a tensor of `shape` may travel as this spec (None matches any size).

        Example:
            >>> spec = BoundarySpec.of(((8, None), "int32"))
            >>> spec.fits((5, 17)), spec.fits((9, 17)), spec.fits((5,))
            (True, False, False)
        """
        shape = tuple(shape)
        return (
            len(shape) == len(self.shape)
            and 0 <= shape[0] <= self.max_batch
            and all(
                want is None or want == got
                for want, got in zip(self.shape[1:], shape[1:], strict=True)
            )
        )


def message_tag(microbatch: int, tensor_index: int, direction: str, num_tensors: int) -> int:
    """The MPI tag of one boundary tensor of one micro-batch in one direction.

    Example:
        >>> [message_tag(1, i, d, 2) for d in DIRECTIONS for i in range(2)]
        [4, 6, 5, 7]
    """
    return (microbatch * num_tensors + tensor_index) * 2 + DIRECTIONS.index(direction)


def header_tag(
    microbatch: int, tensor_index: int, direction: str, num_tensors: int, num_microbatches: int
) -> int:
    """The MPI tag of a dynamic tensor's shape header: above every data tag of the channel.

    Example (3 micro-batches x 2 tensors use data tags 0..11):
        >>> message_tag(1, 0, FORWARD, 2), header_tag(1, 0, FORWARD, 2, 3)
        (4, 16)
    """
    data_tags = 2 * num_microbatches * num_tensors
    return data_tags + message_tag(microbatch, tensor_index, direction, num_tensors)


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


def shape_from_header(header: np.ndarray, count: int, spec: BoundarySpec) -> tuple[int, ...]:
    """The shape a received header of `count` entries announces, checked against `spec`.

    Example:
        >>> shape_from_header(np.array([2, 7, 3]), 3, BoundarySpec.of(((4, None, 3), "int8")))
        (2, 7, 3)
    """
    shape = tuple(int(d) for d in header[:count])
    if count != len(spec.shape) or not spec.fits(shape):
        raise RuntimeError(
            f"received shape header {list(shape)} for {spec}: sender and receiver disagree on "
            "the boundary tensor"
        )
    return shape


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be {FORWARD!r} or {BACKWARD!r}, got {direction!r}")


def check_tensor(tensor, spec: BoundarySpec, direction: str) -> int:
    """Raise unless `tensor` fits `spec`; return its byte count."""
    shape, dtype = tuple(tensor.shape), tf.as_dtype(tensor.dtype)
    if dtype != spec.dtype or not spec.fits(shape):
        raise ValueError(
            f"{direction} tensor of shape {shape} and dtype {dtype.name} does not fit the "
            f"boundary spec {spec.shape} {spec.dtype.name} (batch may only be smaller; None "
            "dimensions take any size)"
        )
    return math.prod(shape) * spec.dtype.size
