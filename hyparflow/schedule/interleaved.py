"""Interleaved 1F1B: each stage holds several model chunks, which divides the bubble.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), section 2.2.2: the model is cut into `p * v` chunks and stage `s` holds
chunks `s, s + p, s + 2p, ...` (`actions.virtual_stage`), so a micro-batch crosses the stages
`v` times. Each stage runs its `m * v` (micro-batch, chunk) forwards in groups of `p`
micro-batches, chunk by chunk (its backwards in the same order, chunks reversed), with
1F1B's warm-up, steady state and drain. With equal chunks the idle fraction falls from
`(p - 1) / (m + p - 1)` to `(p - 1) / (v * m + p - 1)`, for `v` times the point-to-point
messages and, on the first stage, `(v - 1) * p` more micro-batch chunks in flight.

Megatron requires `m` to be a multiple of `p`. Here any `m` works: the order is built for the
next multiple of `p` and the padding micro-batches' actions are left out, so their slots stay
idle. Leaving out a micro-batch whole keeps the order valid: no other micro-batch's action
waits for one of its actions, so every remaining action can only start earlier. The engine
runs it with a runner per chunk (`hyparflow.engine.stages.chunks`, docs/schedules.md).
"""

from __future__ import annotations

from hyparflow.schedule.actions import Action, B, F, Schedule, check_sizes, is_count
from hyparflow.schedule.builders import one_f_one_b


def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B's per-stage lists, `virtual_stages` model chunks per stage (1: 1F1B).

    Example:
        >>> interleaved(2, 2, 2)[0]
        [F0, F1, F0c1, F1c1, B0c1, B1c1, B0, B1]
        >>> interleaved(2, 2, 2)[1]
        [F0, F1, F0c1, B0c1, F1c1, B1c1, B0, B1]
        >>> interleaved(2, 1, 2)[1]  # one micro-batch: the second's slots stay idle
        [F0, F0c1, B0c1, B0]
    """
    check_sizes(num_stages, num_microbatches)
    if not is_count(virtual_stages, 1):
        raise ValueError(f"virtual_stages must be an int >= 1, got {virtual_stages!r}")
    if virtual_stages == 1:
        return one_f_one_b(num_stages, num_microbatches)
    padded = -(-num_microbatches // num_stages) * num_stages  # groups of the stages
    return [
        [
            a
            for a in _stage(stage, num_stages, padded, virtual_stages)
            if a.microbatch < num_microbatches
        ]
        for stage in range(num_stages)
    ]


def _stage(stage: int, num_stages: int, count: int, chunks: int) -> list[Action]:
    total = count * chunks
    warmup = min((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages, total)  # Megatron's
    actions = [_unit(F, k, num_stages, chunks) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [_unit(F, warmup + k, num_stages, chunks), _unit(B, k, num_stages, chunks)]
    return actions + [_unit(B, k, num_stages, chunks) for k in range(total - warmup, total)]


def _unit(make, k: int, num_stages: int, chunks: int) -> Action:
    """The stage's `k`-th forward (`make` F) or backward (B): micro-batches in groups of
    `num_stages`, each group through every chunk in turn (backwards from the last chunk)."""
    group, position = divmod(k, num_stages * chunks)
    chunk = position // num_stages
    if make is B:
        chunk = chunks - 1 - chunk
    return make(group * num_stages + position % num_stages, chunk)
