"""The engine's own buffers on one rank, as the memory plan counts them (pure).

This is the one place to update when the engine's buffers change (docs/memory.md): today a
rank holds flat copies of its gradients (and, for pipeline stages of small variables, of its
parameters) during a step, and at each epoch's end the stages broadcast their weights packed
as float64 (`engine/weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The engine's `engine.flat.FLAT_BACKWARD_MAX_MEAN_BYTES` (memory may not import the engine;
# tests/test_memory_plan.py checks the two agree).
FLAT_BACKWARD_MAX_MEAN_BYTES = 128 * 1024
PACKED_ITEMSIZE = 8  # engine/weights.py packs weights as float64 for one Bcast


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


def step_buffers(facts: StageFacts, slots: float = 0.0) -> dict[str, int]:
    """Named bytes the engine adds to a training step beyond one set of gradients.

    `slots`: the optimizer's state per variable (`optimizer_slots`). The engine runs the
    optimizer as its own compiled call while the step's gradients stay referenced, so the
    update's temporaries add to them instead of reusing them as in Keras's fused train step:
    measured 1.5x the gradients with Adam (docs/memory.md); counted (1 + slots) / 2.

    Example:
        >>> step_buffers(StageFacts(400, 2, stages=1, replicas=2, microbatches=1, world=2))
        {'flat gradients': 400, 'optimizer update': 200}
        >>> step_buffers(StageFacts(400, 2, stages=2, replicas=1, microbatches=4, world=2), 2)
        {'gradient sum': 400, 'optimizer update': 600}
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
    elif flat and facts.replicas > 1:
        buffers["flat gradients"] = g  # the compiled step's (or the stage's) concatenation
    if facts.microbatches > 1:
        buffers["gradient sum"] = g  # the running sum beside the micro-batch's gradients
    buffers["optimizer update"] = int(g * (1 + slots) / 2)
    return buffers


def exchange_buffers(owned_bytes: list[int], stage: int, largest: int = 0, itemsize: int = 4):
    """Named bytes of the epoch end's weight exchange on a rank of stage `stage`.

    Stage k broadcasts the weights it owns (`owned_bytes[k]`, at `itemsize`) packed as float64,
    in turn: the root builds a float64 copy of each variable, then their concatenation (plus
    one variable's `numpy()` copy, `largest` bytes); the last buffer is still referenced while
    the next one is made. The peak is the largest such pair.

    Example:
        >>> exchange_buffers([400, 800], 0)
        {'weights exchange': 3200}
        >>> exchange_buffers([400], 0)
        {}
    """
    if len(owned_bytes) < 2:
        return {}
    scale = PACKED_ITEMSIZE // itemsize
    held, previous = 0, 0
    for k, owned in enumerate(owned_bytes):
        packed = owned * scale
        making = 2 * packed + largest if k == stage else packed
        held = max(held, previous + making)
        previous = packed
    return {"weights exchange": held}


def gather_buffers(largest_split: int) -> dict[str, int]:
    """Named bytes of putting tensor shards back together at an epoch's end
    (`TensorShards.store`): per split variable, in turn, the gathered pieces, their
    concatenation and the tensor assigned from it, while the last variable's are being freed
    (`largest_split`: the whole bytes of the stage's largest split variable; measured 4.4x
    on the MLP of docs/memory.md, counted 4x).

    Example:
        >>> gather_buffers(100), gather_buffers(0)
        ({'shard gather': 400}, {})
    """
    return {"shard gather": 4 * largest_split} if largest_split else {}
