"""ZB-H1: 1F1B with each backward split in two and the weight halves moved into the bubbles.

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR), split each backward into B, the
gradient of the stage's inputs (what the previous stage waits for), and W, the gradient of its
weights (which only the optimizer step waits for). ZB-H1 keeps 1F1B's order of F and B, so B
runs as early as in 1F1B and no stage holds more micro-batches between F and B than 1F1B
does, and runs W behind them: stage `s` starts its W passes `s` steady-state rounds late, so
that every stage holds at most `p` micro-batches between F and W (1F1B's first stage holds `p`
between F and B), and the `s` it owes run in the drain, where 1F1B's stage would wait. With F,
B and W of equal time a step takes `3m + p - 1` pass times for `m >= p` micro-batches, against
1F1B's `3m + 3(p - 1)`: a third of the bubble.
"""

from __future__ import annotations

from hyparflow.schedule.actions import Action, B, F, Schedule, W, check_sizes
from hyparflow.schedule.simulation import simulate


def zero_bubble(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1's per-stage lists of F, B and W passes.

    Example:
        >>> zero_bubble(2, 3)
        [[F0, F1, B0, W0, F2, B1, W1, B2, W2], [F0, B0, F1, B1, W0, F2, B2, W1, W2]]
    """
    check_sizes(num_stages, num_microbatches)
    return [_stage(s, num_stages, num_microbatches) for s in range(num_stages)]


def _stage(stage: int, num_stages: int, count: int) -> list[Action]:
    warmup = min(num_stages - stage - 1, count)  # 1F1B's
    actions = [F(k) for k in range(warmup)]
    weights = 0
    for k in range(count - warmup):  # steady state: one F, one B, and a W once `stage` are owed
        actions += [F(warmup + k), B(k)]
        if k >= stage:
            actions.append(W(weights))
            weights += 1
    for k in range(count - warmup, count):  # drain: a W after each B, where 1F1B waits
        actions.append(B(k))
        if weights <= k:
            actions.append(W(weights))
            weights += 1
    return actions + [W(k) for k in range(weights, count)]


def zero_bubble_bubble(
    num_stages: int, num_microbatches: int, forward: float, backward: float, weight: float
) -> float:
    """ZB-H1's idle fraction with equal stages taking `forward`, `backward` (input half) and
    `weight` per micro-batch, as `simulate` replays the schedule: its formula. With equal times
    and `m >= p` it is `(p - 1) / (3m + p - 1)`; the paper's `(p - 1)(F + B - W)` idle time
    per stage holds only for some ratios (not W > B, nor F < B), so no closed form is used.

    Example:
        >>> round(zero_bubble_bubble(4, 8, 1.0, 1.0, 1.0), 6), round(3 / 27, 6)
        (0.111111, 0.111111)
    """
    schedule = zero_bubble(num_stages, num_microbatches)
    return simulate(schedule, forward, backward, weight_time=weight).bubble
