"""A stage's gradients as one contiguous float32 tensor, so one MPI call reduces them all.

PyTorch DDP gets its speed by letting gradients *be* views of its communication buckets (Li et
al. 2020, "PyTorch Distributed", `gradient_as_bucket_view`). TensorFlow cannot write a
gradient into a given buffer, but the compiled step can concatenate its gradients as its last
op: the copy then runs inside the step (no per-tensor Python work), the reduction is one
`Allreduce` of one buffer, and the optimizer's step splits the result back into views
without copying (TF's Split along the first dimension shares the buffer of aligned spans).
Every piece starts on a 64-byte boundary for that reason.

The reduction writes the sums into the step's own output buffer (no copy in or out). That is
safe because the tensor is a fresh Concat output that TF never shares, and it ends in a
`TAIL`-element piece holding the step's loss, so Grappler can never fold it into a constant.
"""

from __future__ import annotations

import tensorflow as tf

from hyparflow import sizes
from hyparflow.comm.allreduce import DEFAULT_BUCKET_BYTES, plan_buckets
from hyparflow.traced import traced

# Mean gradient bytes per variable up to which a stage's backward is flat (hyparflow/sizes.py).
FLAT_BACKWARD_MAX_MEAN_BYTES = sizes.FLAT_BACKWARD_MAX_MEAN_BYTES
NO_SPLIT = 2**62  # bucket size that puts every gradient in one bucket
TAIL = 16  # 64 bytes of float32 after the gradients, holding a data-dependent value


class FlatLayout:
    """Where each of `variables`' gradients lives in the flat tensor (offsets padded to 64 B).

    `variables`: anything with `shape` and `dtype` (variables, `tf.TensorSpec`s).

    `usable` is False when a variable is not float32 (the flat tensor has one dtype); callers
    then keep gradients as a list.

    Example:
        layout = FlatLayout(model.trainable_variables)
        flat = layout.flatten(grads, loss)    # inside the compiled step
        grads = layout.unflatten_fn(flat)     # views of `flat`, in variable order
    """

    def __init__(self, variables):
        specs = [(tuple(v.shape), v.dtype) for v in variables]
        self.slots, buckets = plan_buckets(specs, NO_SPLIT)
        self.usable = bool(specs) and all(tf.as_dtype(dtype) == tf.float32 for _, dtype in specs)
        gradients_end = buckets[0].length if buckets else 0
        self.tail_offset = -(-gradients_end // TAIL) * TAIL
        self.length = self.tail_offset + TAIL
        self.unflatten_fn = traced(self.unflatten)

    @property
    def flat_backward_pays(self) -> bool:
        """Whether differentiating one flat tensor per micro-batch beats per-variable
        gradients: many small variables (a deep CNN), not a few large ones (a wide MLP).

        Example:
            >>> FlatLayout([tf.TensorSpec((64,))] * 100).flat_backward_pays
            True
            >>> FlatLayout([tf.TensorSpec((1024, 1024)), tf.TensorSpec((1024,))]).flat_backward_pays
            False
        """
        return self.usable and not self.large_variables

    @property
    def large_variables(self) -> bool:
        """Whether the variables average more than `FLAT_BACKWARD_MAX_MEAN_BYTES` of gradient."""
        gradient_bytes = 4 * sum(slot.size for slot in self.slots)
        return gradient_bytes > FLAT_BACKWARD_MAX_MEAN_BYTES * len(self.slots)

    def spans(self) -> list[tuple[int, int | None]]:
        """(size, slot index or None for padding) of every span of the flat tensor, in order.

        Example:
            >>> FlatLayout([tf.TensorSpec((3,)), tf.TensorSpec((2, 2))]).spans()
            [(3, 0), (13, None), (4, 1), (12, None), (16, None)]
        """
        spans, position = [], 0
        for number, slot in enumerate(self.slots):
            if slot.offset > position:
                spans.append((slot.offset - position, None))
            spans.append((slot.size, number))
            position = slot.offset + slot.size
        if self.tail_offset > position:
            spans.append((self.tail_offset - position, None))
        spans.append((TAIL, None))
        return spans

    def zeros(self) -> tf.Tensor:
        """A flat tensor of zeros (no gradient yet)."""
        return tf.zeros([self.length], tf.float32)

    def flatten(self, grads, tail) -> tf.Tensor:
        """The gradients concatenated in layout order, zeros in the padding and the scalar
        `tail` (a value computed from the step's data, e.g. its loss) in the last span."""
        spans = self.spans()
        parts = []
        for size, number in spans[:-1]:
            if number is None:
                parts.append(tf.zeros([size], tf.float32))
            else:
                parts.append(tf.reshape(tf.cast(grads[number], tf.float32), [-1]))
        parts.append(tf.fill([TAIL], tf.cast(tail, tf.float32)))
        return tf.concat(parts, axis=0)

    def unflatten(self, flat) -> list:
        """The gradients back in their shapes and order, as views of `flat` (graph ops)."""
        spans = self.spans()
        parts = tf.split(flat, [size for size, _ in spans], axis=0)
        grads = [None] * len(self.slots)
        for part, (_, number) in zip(parts, spans, strict=True):
            if number is not None:
                grads[number] = tf.reshape(part, self.slots[number].shape)
        return grads


class BucketedLayout:
    """A `FlatLayout` cut into buckets of about `bucket_bytes`: the flat gradient as a tuple of
    flat tensors, one per bucket of consecutive variables (a larger variable gets its own).

    One concat of the whole model needs every per-variable gradient alive beside its output:
    twice the gradient bytes at the peak. A bucket's concat needs only its own variables'
    gradients, which die as soon as it has run, so the step holds the gradients about once
    (docs/engine.md, "Memory"). Each bucket is a `FlatLayout` of its own (aligned spans, a
    data-dependent tail), so `GradientReducer.reduce_flat` reduces each one in place.

    Example:
        >>> specs = [tf.TensorSpec((1024, 1024))] * 3 + [tf.TensorSpec((10,))]
        >>> [len(c.slots) for c in BucketedLayout(specs, bucket_bytes=8 * 2**20).buckets]
        [2, 2]
    """

    def __init__(self, variables, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        specs = list(variables)
        whole = FlatLayout(specs)
        self.usable, self.slots = whole.usable, whole.slots
        _, buckets = plan_buckets([(tuple(v.shape), tf.float32) for v in specs], bucket_bytes)
        self.members = [bucket.indices for bucket in buckets]
        self.buckets = [FlatLayout([specs[i] for i in members]) for members in self.members]
        self.length = sum(bucket.length for bucket in self.buckets)
        self.unflatten_fn = traced(self.unflatten)

    def zeros(self) -> tuple:
        return tuple(bucket.zeros() for bucket in self.buckets)

    def flatten(self, grads, tail) -> tuple:
        """One flat tensor per bucket (`FlatLayout.flatten` of its gradients)."""
        return tuple(
            bucket.flatten([grads[i] for i in members], tail)
            for bucket, members in zip(self.buckets, self.members, strict=True)
        )

    def unflatten(self, flat) -> list:
        """The gradients in their shapes and order, as views of the buckets (graph ops)."""
        grads = [None] * len(self.slots)
        for bucket, members, part in zip(self.buckets, self.members, flat, strict=True):
            for i, grad in zip(members, bucket.unflatten(part), strict=True):
                grads[i] = grad
        return grads
