"""Contiguous split of a sequence of costs into stages minimizing the slowest stage (exact DP)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_contiguous(
    costs: Sequence[float], num_parts: int, cut_costs: Sequence[float] | None = None
) -> list[int]:
    """Start positions of `num_parts` non-empty contiguous stages minimizing the maximum cost.

    This is the linear partition (chains-on-chains) problem, solved exactly by dynamic
    programming as in Bokhari, "Partitioning problems in parallel, pipelined, and distributed
    computing", IEEE Trans. Computers 37(1), 1988, and in PipeDream's planner (Narayanan et al.,
    SOSP 2019):

        best[m][j] = min over a < j of max(best[m-1][a], cost(a, j))

    where best[m][j] is the smallest possible slowest stage when the first j items form m
    stages. The cost of stage [a, b) is sum(costs[a:b]) + cut_costs[a] + cut_costs[b]: a cut
    cost (e.g. bytes crossing the cut / bandwidth) is paid by the stage on each side of it.
    `cut_costs` has len(costs) + 1 entries; entries 0 and len(costs) (model input and output)
    are ignored.

    Without cut costs both terms are monotone in `a`, so the optimum lies where they cross and
    a binary search finds it: O(num_parts * n log n). With cut costs every `a` is tried:
    O(num_parts * n^2), vectorized per `j`.

    Example:
        >>> split_contiguous([1, 1, 1, 3], 2)
        [0, 3]
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, got {num_parts}.")
    if num_parts > n:
        raise ValueError(f"Cannot split {n} items into {num_parts} non-empty stages.")
    if np.any(costs < 0) or not np.all(np.isfinite(costs)):
        raise ValueError("Costs must be finite and non-negative.")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    cuts = _cut_costs(cut_costs, n)
    if cuts is None:
        cuts = np.zeros(n + 1)

    best = prefix + cuts  # best[j]: one stage holding the first j items
    best[0] = np.inf
    choices = []
    for m in range(2, num_parts + 1):
        if not np.any(cuts):
            best, choice = _extend_monotone(best, prefix, m)
        else:
            best, choice = _extend_general(best, prefix, cuts, m)
        choices.append(choice)
    starts = [n]
    for choice in reversed(choices):
        starts.append(int(choice[starts[-1]]))
    starts.append(0)
    return sorted(set(starts[1:]))


def split_between(
    costs: Sequence[float],
    num_parts: int,
    cut_costs: Sequence[float] | None = None,
    forbidden: Sequence[int] = (),
) -> list[int]:
    """`split_contiguous` where no stage may begin at a `forbidden` position: the items
    between allowed cuts are split as one.

    Example:
        >>> split_between([1, 1, 1, 3], 2, forbidden=[3])
        [0, 2]
    """
    n = len(costs)
    no = set(forbidden)
    groups = [0] + [p for p in range(1, n) if p not in no]
    if num_parts > len(groups):
        raise ValueError(
            f"Cannot split into {num_parts} stages: only {len(groups) - 1} places to cut do "
            "not separate a Keras mask from the layers that read it; use fewer stages."
        )
    bounds = [*groups, n]
    group_costs = [float(np.sum(costs[a:b])) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    group_cuts = None
    if cut_costs is not None:
        group_cuts = [cut_costs[p] for p in bounds]
    return [groups[g] for g in split_contiguous(group_costs, num_parts, group_cuts)]


def stage_costs(
    costs: Sequence[float], starts: Sequence[int], cut_costs: Sequence[float] | None = None
) -> list[float]:
    """Cost of each stage of the split given by `starts` (same cost model as the split).

    Example:
        >>> stage_costs([1, 1, 1, 3], [0, 3])
        [3.0, 3.0]
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    cuts = _cut_costs(cut_costs, n)
    bounds = list(starts) + [n]
    result = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        extra = 0.0 if cuts is None else cuts[a] + cuts[b]
        result.append(float(costs[a:b].sum() + extra))
    return result


def _cut_costs(cut_costs, n):
    if cut_costs is None:
        return None
    cuts = np.array(cut_costs, dtype=np.float64)
    if cuts.shape != (n + 1,):
        raise ValueError(f"cut_costs needs {n + 1} entries (one per cut), got {cuts.shape}.")
    cuts[0] = cuts[n] = 0.0
    return cuts


def _extend_monotone(previous, prefix, m):
    """One DP step without cut costs: binary search for where the two terms cross."""
    n = len(prefix) - 1
    best = np.full(n + 1, np.inf)
    choice = np.zeros(n + 1, dtype=np.int64)
    j = np.arange(m, n + 1)
    a_low = m - 1  # stage m-1 ends at a >= m-1 so that earlier stages are non-empty
    # previous[a] + prefix[a] is non-decreasing in a; the crossing is the first a where it
    # reaches prefix[j] (there previous[a] >= prefix[j] - prefix[a]).
    crossing = a_low + np.searchsorted(previous[a_low:n] + prefix[a_low:n], prefix[j])
    candidates = np.stack([crossing - 1, crossing])
    candidates = np.clip(candidates, a_low, j - 1)
    values = np.maximum(previous[candidates], prefix[j] - prefix[candidates])
    pick = np.argmin(values, axis=0)
    best[j] = values[pick, np.arange(len(j))]
    choice[j] = candidates[pick, np.arange(len(j))]
    return best, choice


def _extend_general(previous, prefix, cuts, m):
    """One DP step with cut costs (cost(a, j) is not monotone in a): try every a."""
    n = len(prefix) - 1
    best = np.full(n + 1, np.inf)
    choice = np.zeros(n + 1, dtype=np.int64)
    for j in range(m, n + 1):
        a = slice(m - 1, j)
        values = np.maximum(previous[a], prefix[j] - prefix[a] + cuts[a] + cuts[j])
        i = int(np.argmin(values))
        best[j] = values[i]
        choice[j] = m - 1 + i
    return best, choice
