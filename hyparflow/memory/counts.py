"""The memory plan's arithmetic: micro-batches in flight, activations, optimizer state (pure).

Nothing here imports TensorFlow, Keras or MPI, so the formulas of docs/memory.md are
unit-tested in milliseconds; `hyparflow.memory.plan` feeds them a model's facts.
"""

from __future__ import annotations

import math

from hyparflow.schedule.actions import BACKWARD


def in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under `schedule`.

    GPipe forwards every micro-batch before the first backward; 1F1B (PipeDream-Flush) runs
    `p - s - 1` warm-up forwards, so at most `min(m, p - s)` are in flight; ZB-H1 keeps a
    micro-batch until its weight half, `min(m, p)` on every stage (the engine's
    `schedule.peak_in_flight`, which the tests compare this with).

    Example:
        >>> in_flight("gpipe", 4, 8, 0), in_flight("1f1b", 4, 8, 0), in_flight("1f1b", 4, 8, 3)
        (8, 4, 1)
    """
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    if schedule == "zero_bubble":  # until its weight half: at most p on every stage
        return min(microbatches, stages)
    return microbatches


def chunk_activation_bytes(
    stage_actions, per_chunk: list[tuple[int, int]], samples: int, recompute: bool = False
) -> int:
    """Bytes of activations an interleaved stage keeps at its peak: walking its actions
    (`schedule.interleaved`'s list for the stage), each micro-batch forwarded through chunk `c`
    and not yet backwarded keeps `per_chunk[c]` = (layer output bytes, received input bytes)
    per sample, as `activation_bytes` counts one; with recompute only the inputs, plus the
    largest chunk's outputs while its backward replays it.

    Example:
        >>> from hyparflow.schedule import make_schedule
        >>> actions = make_schedule("interleaved", 2, 2, virtual_stages=2)[0]
        >>> actions
        [F0, F1, F0c1, F1c1, B0c1, B1c1, B0, B1]
        >>> chunk_activation_bytes(actions, [(1000, 100), (10, 1)], 8)  # all four at once
        17776
    """
    kept = [received + (0 if recompute else layer) for layer, received in per_chunk]
    held = [0] * len(per_chunk)  # micro-batches in flight through each chunk
    peak = 0
    for action in stage_actions:
        if action.is_forward:
            held[action.chunk] += 1
            peak = max(peak, sum(n * b for n, b in zip(held, kept, strict=True)))
        elif action.kind is BACKWARD:
            held[action.chunk] -= 1
    replay = max(layer for layer, _ in per_chunk) if recompute else 0
    return samples * (peak + replay)


def microbatch_size(batch_size: int, replicas: int, microbatches: int) -> int:
    """Samples in a replica's largest micro-batch (the engine splits as evenly as it can).

    Example:
        >>> microbatch_size(64, 2, 4), microbatch_size(10, 1, 4)
        (8, 3)
    """
    shard = math.ceil(batch_size / replicas)
    return math.ceil(shard / microbatches)


def activation_bytes(
    layer_bytes: int,
    input_bytes: int,
    samples: int,
    in_flight_count: int,
    recompute: bool = False,
) -> int:
    """Bytes of activations a stage keeps between forwards and backwards.

    `layer_bytes`: the outputs of the stage's layers per sample; `input_bytes`: what the stage
    receives per sample. Without recompute every in-flight micro-batch keeps both; with
    recompute only its inputs, plus one micro-batch's outputs while its backward replays it.

    Example:
        >>> activation_bytes(1000, 100, 8, 4), activation_bytes(1000, 100, 8, 4, recompute=True)
        (35200, 11200)
    """
    if recompute:
        return samples * (input_bytes * in_flight_count + layer_bytes)
    return samples * (layer_bytes + input_bytes) * in_flight_count


def optimizer_bytes(
    trainable_bytes: int, slots: float, replicas: int = 1, shard_optimizer: bool = False
) -> int:
    """Bytes of optimizer state: `slots` copies of the trainable variables (Adam 2, SGD with
    momentum 1, plain SGD 0), divided over the replicas when they shard it (ZeRO-1).

    Example:
        >>> optimizer_bytes(1000, 2), optimizer_bytes(1000, 2, replicas=4, shard_optimizer=True)
        (2000, 500)
    """
    total = trainable_bytes * slots
    if shard_optimizer and replicas > 1:
        total /= replicas
    return int(math.ceil(total))


def peak(persistent: int, step: int, exchange: int) -> int:
    """A rank's peak: what lives all along, a step's transients (gradients, activations, step
    buffers) and the epoch end's weight exchange. The last two happen at different times but
    add up in resident memory: glibc keeps the step's freed memory in its heap for the next
    step, and the exchange's large numpy buffers are fresh mappings (measured, docs/memory.md).

    Example:
        >>> peak(100, 30, 50)
        180
    """
    return persistent + step + exchange
