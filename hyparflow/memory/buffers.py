"""The engine's own buffers on one rank, as the memory plan counts them (pure).

This is the one place to update when the engine's buffers change (docs/memory.md): today a
data-parallel step concatenates its gradients in buckets of `BUCKET_BYTES`
(`engine/gradients/flat.py`), a pipeline stage of small variables packs its parameters and gradients
whole, the optimizer updates groups of about `UPDATE_GROUP_BYTES` of variables at a time
(`engine/gradients/update_plan.py`), ZeRO-1 updates its slice in one call
(`engine/sharded_optimizer/sharded_update.py`), and at each
epoch's end the stages broadcast their weights in groups of about `BUCKET_BYTES`
(`engine/weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The sizes the engine uses, from the one module both read (no copy to keep in step).
from hyparflow.sizes import (
    BUCKET_BYTES,
    FLAT_BACKWARD_MAX_MEAN_BYTES,
    SEGMENT_BYTES,
    UPDATE_GROUP_BYTES,
    most_segments,
)


@dataclass(frozen=True)
class StageFacts:
    """What the engine's buffers depend on, for one rank's stage.

    `gradient_bytes`: float32 bytes of its dense trainable variables (the flat tensor);
    `variables`: how many; `world`: ranks in the job (1: plain `model.fit`, no engine).
    """

    gradient_bytes: int
    variables: int
    stages: int
    replicas: int
    microbatches: int
    world: int
    flat_gradients: bool = True
    largest: int = 0  # bytes of its largest variable
    tensor: int = 1
    by_segment: bool = False  # Strategy.update_by_segment as resolved (hf.scope(): True)
    cuttable: bool = True  # a layer graph (a subclassed model is one segment)
    shard_optimizer: bool = False  # ZeRO-1
    shard_gradients: bool = False  # ZeRO-2: cut into segments, each scattered per micro-batch
    shard_weights: bool = False  # ZeRO-3: each segment's weights gathered for each call
    by_layer: bool = False  # ZeRO-3 on a subclassed model: each layer gathered around its call


def segments(facts: StageFacts) -> int:
    """Segments whose updates a stage applies one by one during its last backward
    (engine/gradients/segment_update.py, `Strategy.update_by_segment`): one per `SEGMENT_BYTES` of
    gradients, at most `MAX_SEGMENTS` (`MAX_GATHERED_SEGMENTS` under ZeRO-3); 1 where the stage
    is not cut.

    Example:
        >>> segments(StageFacts(64 * 2**20, 8, stages=4, replicas=1, microbatches=1, world=4,
        ...                     by_segment=True))
        4
    """
    if facts.world == 1 or facts.tensor > 1 or not facts.cuttable:
        return 1
    gathered = facts.shard_weights and facts.replicas > 1  # ZeRO-3: smaller segments
    count = min(most_segments(gathered), facts.gradient_bytes // SEGMENT_BYTES)
    if facts.shard_gradients and facts.replicas > 1:
        return max(2, count)
    return max(1, count) if facts.by_segment else 1


def held_gradients(facts: StageFacts, gradient_bytes: int) -> int:
    """Of a step's `gradient_bytes`, those alive at once: a segment's where the stage updates
    segment by segment; under ZeRO-3 by layer, this replica's slices and the largest
    variable's whole gradient (a layer's, being reduce-scattered); else all."""
    if facts.by_layer:
        return -(-gradient_bytes // facts.replicas) + facts.largest
    return -(-gradient_bytes // segments(facts))


def step_buffers(facts: StageFacts, slots: float = 0.0, sharded: bool = False) -> dict[str, int]:
    """Named bytes the engine adds to a training step beyond one set of gradients.

    `slots`: the optimizer's state per variable (`optimizer_slots`). The engine runs the
    optimizer as compiled calls after the backward, so the update's temporaries (Adam's:
    measured 1.5x the gradients it is given, counted (1 + slots) / 2) add to the step's
    gradients instead of reusing them as Keras's fused train step does; it updates groups of
    about `UPDATE_GROUP_BYTES` of variables (a larger one alone), so the temporaries are one
    group's. `sharded` (ZeRO-1, replicas > 1): this replica's slice variables (a slice of the
    stage), and the update of one segment's slice at a time (the stage's where it is not cut),
    whose received sums and their tensor are each that slice's bytes, and parameters broadcast
    through one variable's buffer. ZeRO-2 (`shard_gradients`) holds one segment's gradients
    and, over micro-batches, the sums of its slices instead of the whole stage's. ZeRO-3
    (`shard_weights`) adds one segment's gathered weights, twice (received, then read out);
    by layer, the largest variable three times (the next layer's gathered ahead).

    Example:
        >>> step_buffers(StageFacts(400, 2, stages=1, replicas=2, microbatches=1, world=2))
        {'flat gradients': 400, 'optimizer update': 200}
        >>> stage = StageFacts(400, 2, stages=2, replicas=1, microbatches=4, world=2)
        >>> step_buffers(stage, 2)["gradient sum"], step_buffers(stage, 2)["optimizer update"]
        (400, 600)
    """
    g = facts.gradient_bytes
    if facts.world == 1 or g == 0:
        return {}
    buffers = {}
    pipelined = facts.stages > 1
    flat = facts.flat_gradients and (facts.replicas > 1 or pipelined)
    small = g <= FLAT_BACKWARD_MAX_MEAN_BYTES * max(1, facts.variables)
    if pipelined and flat and small:
        # flat backward: the step's parameter values packed once, gradients concatenated
        buffers["flat parameters"] = g
        buffers["flat gradients"] = g
    elif segments(facts) > 1:
        if facts.replicas > 1 and not sharded:  # a segment's gradients concatenated to be summed
            buffers["segment sum"] = held_gradients(facts, g)
    elif flat and facts.replicas > 1:
        # a pipeline stage concatenates its gradients once; the whole model in buckets
        buffers["flat gradients"] = g if pipelined else min(g, BUCKET_BYTES)
    if facts.shard_weights and facts.replicas > 1:
        # one segment's weights gathered (the whole stage's where it is not cut): the flat
        # vector received and the tensors read out of it; by layer, also the next layer's,
        # gathered ahead
        if facts.by_layer:
            buffers["gathered weights"] = 3 * facts.largest
        else:
            buffers["gathered weights"] = 2 * held_gradients(facts, g)
    zero2 = facts.shard_gradients and facts.replicas > 1 and segments(facts) > 1
    if facts.microbatches > 1:
        # the running sum beside the micro-batch's gradients; ZeRO-2 sums this replica's
        # slices, each segment scattered into them as it is made
        buffers["gradient sum"] = held_gradients(facts, g) + -(-g // facts.replicas) if zero2 else g
    if sharded and facts.replicas > 1:
        # the update of one segment's slice (the whole stage's where it is not cut)
        part = -(-held_gradients(facts, g) // facts.replicas)
        if segments(facts) > 1:  # reduce-scattered through one window's buffer
            buffers["flat gradients"] = min(held_gradients(facts, g), BUCKET_BYTES)
        buffers["optimizer update"] = int(part * (1 + slots) / 2)
        if facts.shard_weights:  # the slices are the weights: received sums, no broadcast
            buffers["slice copies"] = 2 * part
            return buffers
        # every slice variable, plus the received sums of one and their tensor
        buffers["slice copies"] = -(-g // facts.replicas) + 2 * part
        buffers["parameter broadcast"] = 2 * facts.largest
        return buffers
    group = max(UPDATE_GROUP_BYTES, facts.largest)
    buffers["optimizer update"] = int(min(g, group) * (1 + slots) / 2)
    return buffers


def exchange_buffers(owned_bytes: list[int], stage: int, largest: int = 0, itemsize: int = 4):
    """Named bytes of the epoch end's weight exchange on a rank of stage `stage`: each stage
    broadcasts the weights it owns (`owned_bytes`) as raw bytes in groups of about
    `BUCKET_BYTES` (a larger weight alone, `largest` bytes); the root copies a group and joins
    it, a receiver holds one group and the tensor assigned from it.

    Example:
        >>> exchange_buffers([400, 800], 0)
        {'weights exchange': 1600}
        >>> exchange_buffers([400], 0)
        {}
    """
    if len(owned_bytes) < 2:
        return {}
    group = min(max(BUCKET_BYTES, largest), max(owned_bytes))
    return {"weights exchange": 2 * group}


def saving_buffers(held_bytes: int, group_bytes: int, root: bool) -> dict[str, int]:
    """Named bytes of gathering the whole optimizer state on rank 0 after a split fit, so that
    its saved files carry it (engine/loops/optimizer_gather.py): the slots a rank copies out
    (`held_bytes`) and sends, or on rank 0 writes to its disk with every other rank's as they
    arrive (checkpoint/spill.py), plus one group of raw bytes in transit.

    Example:
        >>> saving_buffers(2000, 300, root=True), saving_buffers(0, 300, root=False)
        ({'optimizer spilled for saving': 2300}, {})
    """
    if not held_bytes:
        return {}
    name = "optimizer spilled for saving" if root else "optimizer sent for saving"
    return {name: held_bytes + group_bytes}


def gather_buffers(largest_piece: int) -> dict[str, int]:
    """Named bytes of putting tensor (or expert) shards back together at an epoch's end
    (`Shard.store`): per split variable, in turn, this rank's piece copied out, the buffer
    each owner's piece is broadcast into and the tensor assigned from it into its place
    (`largest_piece`: the bytes of the stage's largest piece of a split variable). Before
    pieces were assigned one by one, the gathered pieces and their concatenation took 4x the
    whole variable (4.4x measured on the MLP of docs/memory.md).

    Example:
        >>> gather_buffers(100), gather_buffers(0)
        ({'shard gather': 300}, {})
    """
    return {"shard gather": 3 * largest_piece} if largest_piece else {}
