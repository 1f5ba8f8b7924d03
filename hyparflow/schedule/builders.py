"""The schedules a pipeline step can run, built as per-stage lists of passes.

- GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism"): every stage runs all forwards, then all backwards. Each stage holds the
  activations of all `m` micro-batches at once.
- 1F1B, a.k.a. PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): stage `s` runs `p - s - 1` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Same bubble as GPipe, but at most `p - s`
  micro-batches are in flight on stage `s`.
"""

from __future__ import annotations

from hyparflow.schedule.actions import B, F, Schedule, check_sizes


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: on every stage, all forwards in order, then all backwards in order.

    Example:
        >>> gpipe(2, 3)
        [[F0, F1, F2, B0, B1, B2], [F0, F1, F2, B0, B1, B2]]
    """
    check_sizes(num_stages, num_microbatches)
    stage = [F(i) for i in range(num_microbatches)] + [B(i) for i in range(num_microbatches)]
    return [list(stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, alternate one forward and one backward, drain.

    Stage `s` first runs `min(p - s - 1, m)` forwards, so at most `min(p - s, m)` micro-batches
    are in flight on it at any time.

    Example:
        >>> one_f_one_b(2, 3)
        [[F0, F1, B0, F2, B1, B2], [F0, B0, F1, B1, F2, B2]]
    """
    check_sizes(num_stages, num_microbatches)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [F(i) for i in range(warmup)]
        for i in range(warmup, num_microbatches):
            actions += [F(i), B(i - warmup)]
        actions += [B(i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(actions)
    return schedule


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Evaluation and prediction: every stage forwards every micro-batch in order, through
    each of its `num_chunks` model chunks in turn (interleaved stages hold several).

    Example:
        >>> forward_only(2, 2)
        [[F0, F1], [F0, F1]]
        >>> forward_only(2, 2, num_chunks=2)[0]
        [F0, F1, F0c1, F1c1]
    """
    check_sizes(num_stages, num_microbatches)
    stage = [F(i, c) for c in range(num_chunks) for i in range(num_microbatches)]
    return [list(stage) for _ in range(num_stages)]
