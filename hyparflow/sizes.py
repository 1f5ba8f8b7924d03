"""Sizes of the engine's buffers, read by the engine and by the memory plan alike (pure).

They sit below both (docs/architecture.md) so that the memory plan counts the very sizes the
engine uses, with no copy to keep in step.
"""

# Bytes per bucket: a data-parallel step's flat gradients (engine/gradients/flat.py), an allreduce
# bucket (comm/allreduce.py's DEFAULT_BUCKET_BYTES), a ZeRO-1 window
# (engine/sharded_optimizer/sharded_update.py), a group of the weights' broadcast
# (engine/weights.py). Like PyTorch DDP's default: big enough that per-call latency is amortized,
# small enough that the first buckets can be reduced while later gradients are still being computed.
BUCKET_BYTES = 25 * 2**20

# Mean gradient bytes per variable up to which a pipeline stage differentiates one flat
# tensor per micro-batch (engine/gradients/flat.py's `flat_backward_pays`): a per-variable backward
# costs Python and eager work per variable, a flat one copies every gradient byte once more (the
# concat). The measurement behind the threshold: docs/notes/benchmarks.md ("One-off measurements").
FLAT_BACKWARD_MAX_MEAN_BYTES = 128 * 1024

# Bytes of variables updated per compiled optimizer call when a step's update is grouped
# (engine/gradients/update_plan.py's GROUP_BYTES): an optimizer given every gradient at once runs
# all variables' updates side by side, their temporaries (Adam's: about 1.5x the gradients) alive
# together; in groups they are one group's, and each group's gradients can go once it is
# applied. A group closes once it holds this many bytes, so a larger variable is a group of its
# own (measured on a P=4 rank of 16 MiB kernels: 31 MiB lower peak than groups of 25 MiB, i.e.
# two kernels; docs/memory.md).
UPDATE_GROUP_BYTES = 8 * 2**20

# A stage whose gradients exceed two of these is cut into segments of about this many bytes
# for `update_per_segment` (engine/gradients/form.py's `segments_for`), at most MAX_SEGMENTS: a
# segment's call costs ~0.1 ms, nothing next to the compute of 16 MiB of weights. Measured on
# a 2048 x 6 MLP at R=2: segments of 16 MiB grew a rank by 372-380 MiB, of 32 MiB by 417-429
# (one process: 392-399), 5% slower.
SEGMENT_BYTES = 16 * 2**20
MAX_SEGMENTS = 8
# Under ZeRO-3 a segment is also what a rank gathers whole (and the next one, prefetched, and
# its gradients): more, smaller segments, as FSDP wraps each block. Measured on a 102M-parameter
# transformer of 14 blocks at R=4 under hf.scope() (batch 4, benchmarks/sharded_memory.py):
# the allocator's peak was 0.308-0.311 of one process's with 8 segments, 0.261 with 14, 0.250
# with 24.
MAX_GATHERED_SEGMENTS = 32


def most_segments(gathered: bool) -> int:
    """The most segments a stage is cut into: `MAX_GATHERED_SEGMENTS` where ZeRO-3 gathers
    each one whole (`gathered`: weights sharded over several replicas), else `MAX_SEGMENTS`."""
    return MAX_GATHERED_SEGMENTS if gathered else MAX_SEGMENTS
