"""Top-k dispatch with the experts split over ranks: tokens travel to their expert's rank and
back by all-to-all (GShard, Lepikhin et al. 2020; DeepSpeed-MoE, Rajbhandari et al. 2022).

Each of the `comm` ranks holds `num_experts / size` consecutive experts. A rank sorts its
picks by the rank holding their expert, sends each pick's token row there (one `Alltoallv`,
the local expert of each row beside it), computes the rows it received through its own
experts (`dispatch.grouped`), and sends the results back the same way reversed. The gradient
of an exchange is the exchange of the upstream gradient in the other direction. No capacity
limit by default: every pick is computed, so the sum equals the one-rank mixture to float
rounding; an optional capacity factor drops the picks past it (not exact).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from hyparflow.comm.in_graph import exchange
from hyparflow.moe.dispatch import grouped, scattered, weighted_sum, within_capacity

# The traffic of every exchange (`hyparflow.comm.in_graph.traffic(TAG)`): the profiler's
# "experts" category, with the routing counts' allreduce (`router_loss`).
TAG = "experts"


def expert_parallel_mixture(
    tokens: tf.Tensor,
    expert_index: tf.Tensor,
    expert_weight: tf.Tensor,
    num_experts: int,
    expert: Callable[[int, tf.Tensor], tf.Tensor],
    comm,
    capacity_factor: float | None = None,
) -> tf.Tensor:
    """`dispatch.top_k_mixture` of this rank's tokens, with expert `e` held by rank
    `e // (num_experts / comm size)` of `comm`: `expert(local e, rows)` computes this rank's
    experts only. Collective over `comm` (every rank calls it in the same order). With a
    `capacity_factor`, a rank sends each expert at most its capacity of this rank's picks
    (`dispatch.within_capacity`); the others are neither sent nor computed."""
    held = num_experts // comm.Get_size()
    picks = tf.shape(expert_index)[1]
    every = tf.reshape(tf.cast(expert_index, tf.int32), [-1])  # pick p = t * k + j
    if capacity_factor is None:
        kept = tf.range(tf.size(every))
    else:
        kept = tf.where(
            tf.reshape(within_capacity(expert_index, num_experts, capacity_factor), [-1])
        )
        kept = tf.cast(kept[:, 0], tf.int32)
    flat = tf.gather(every, kept)
    owner = flat // held
    order = tf.argsort(owner, stable=True)  # picks grouped by the rank that computes them
    counts = tf.math.bincount(owner, minlength=comm.Get_size(), maxlength=comm.Get_size())
    local_expert = tf.gather(flat % held, order)
    rows = tf.gather(tokens, tf.gather(kept, order) // picks)
    arrived = {}
    received = _sent(comm, rows, counts, arrived, local_expert)
    results = grouped(arrived["expert"], held, expert, lambda chosen: tf.gather(received, chosen))
    returned = _sent(comm, results, arrived["counts"], {}, expected=counts)
    per_pick = tf.gather(returned, tf.math.invert_permutation(order))
    if capacity_factor is not None:
        per_pick = scattered(per_pick, kept, tf.size(every))
    return weighted_sum(per_pick, tokens, expert_weight)


def _sent(comm, rows, counts, arrived: dict, beside=None, expected=None):
    """`rows` exchanged by `counts` (differentiable in `rows`); `arrived` gets the counts
    received from each rank and, with `beside` (int rows sent alongside), those rows;
    `expected`: the counts to receive, where known."""
    extra = [] if beside is None else [beside]

    @tf.custom_gradient
    def sent(rows):
        received_counts, (received, *others) = exchange(
            comm, counts, [rows, *extra], TAG, expected
        )  # fmt: skip
        arrived["counts"] = received_counts
        if others:
            arrived["expert"] = others[0]

        def gradient(upstream):  # a gather's gradient arrives as row slices: made dense
            upstream = tf.convert_to_tensor(upstream)
            _, (back,) = exchange(comm, received_counts, [upstream], TAG, counts)
            return back

        return received, gradient

    return sent(rows)
