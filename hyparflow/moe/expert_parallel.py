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
from hyparflow.comm.traffic import TrafficLog
from hyparflow.moe.dispatch import grouped, kept_picks, scattered, weighted_sum

# The profiler's "experts" category, in the records of a `TrafficLog`: every exchange and the
# routing counts' allreduce across replicas (`router_loss`) in `of(TAG)`, and the local
# experts' compute between the exchanges in `of(PHASE_TAGS["compute"])` (no bytes). The
# phases apart: the tokens' exchange to their experts and their gradients' back ("dispatch"),
# the results' back and their gradients' to the experts ("combine").
TAG = "experts"
PHASES = ("dispatch", "compute", "combine")
PHASE_TAGS = {phase: f"{TAG}/{phase}" for phase in PHASES}
SPAN_TAGS = (TAG, PHASE_TAGS["compute"])  # the profiler's spans: each exchange, each compute


def expert_parallel_mixture(
    tokens: tf.Tensor,
    expert_index: tf.Tensor,
    expert_weight: tf.Tensor,
    num_experts: int,
    expert: Callable[[int, tf.Tensor], tf.Tensor],
    comm,
    traffic: TrafficLog,
    capacity_factor: float | None = None,
) -> tf.Tensor:
    """`dispatch.top_k_mixture` of this rank's tokens, with expert `e` held by rank
    `e // (num_experts / comm size)` of `comm`: `expert(local e, rows)` computes this rank's
    experts only. Collective over `comm` (every rank calls it in the same order), counted in
    `traffic`'s records of `TAG` and `PHASE_TAGS`. With a
    `capacity_factor`, a rank sends each expert at most its capacity of this rank's picks
    (`dispatch.within_capacity`); the others are neither sent nor computed."""
    held = num_experts // comm.Get_size()
    picks = tf.shape(expert_index)[1]
    every = tf.reshape(tf.cast(expert_index, tf.int32), [-1])  # pick p = t * k + j
    kept = (
        None if capacity_factor is None else kept_picks(expert_index, num_experts, capacity_factor)
    )
    flat = every if kept is None else tf.gather(every, kept)
    owner = flat // held
    order = tf.argsort(owner, stable=True)  # picks grouped by the rank that computes them
    counts = tf.math.bincount(owner, minlength=comm.Get_size(), maxlength=comm.Get_size())
    local_expert = tf.gather(flat % held, order)
    rows = tf.gather(tokens, (order if kept is None else tf.gather(kept, order)) // picks)
    arrived, clock = {}, _ComputeClock(traffic.of(PHASE_TAGS["compute"]))
    received = _sent(comm, traffic, rows, counts, arrived, clock, "dispatch", beside=local_expert)
    results = grouped(arrived["expert"], held, expert, lambda chosen: tf.gather(received, chosen))
    returned = _sent(
        comm, traffic, results, arrived["counts"], {}, clock, "combine", expected=counts
    )
    per_pick = tf.gather(returned, tf.math.invert_permutation(order))
    if kept is not None:
        per_pick = scattered(per_pick, kept, tf.size(every))
    return weighted_sum(per_pick, tokens, expert_weight)


class _ComputeClock:
    """Times one mixture call's local experts, as spans of `PHASE_TAGS["compute"]`: from the
    dispatch's end to the combine's start in the forward, from the combine's gradient's end to
    the dispatch's gradient's start in the backward (the exchanges are ordered collectives,
    so nothing of another block's falls in between), into `record`."""

    def __init__(self, record):
        self.record = record
        self.arrived = None

    def arrive(self, start: float, end: float) -> None:
        self.arrived = end

    def depart(self, start: float, end: float) -> None:
        if self.arrived is not None:
            self.record.record(self.arrived, start, 0)
        self.arrived = None


def _phase_timer(record, clock: _ComputeClock, arrival: bool):
    """`exchange`'s `timed`: the exchange counted in its phase's `record`, and on `clock` as
    rows arriving at the experts (`arrival`) or leaving them."""

    def timed(start: float, end: float, nbytes: int) -> None:
        record.record(start, end, nbytes)
        (clock.arrive if arrival else clock.depart)(start, end)

    return timed


def _sent(comm, traffic, rows, counts, arrived: dict, clock, phase, beside=None, expected=None):
    """`rows` exchanged by `counts` (differentiable in `rows`) as `phase` ("dispatch": tokens
    to the experts, "combine": results back), counted in `traffic` and timed by `clock`;
    `arrived` gets the counts received from each rank and, with `beside` (int rows sent
    alongside), those rows; `expected`: the counts to receive, where known."""
    extra = [] if beside is None else [beside]
    exchanges, record = traffic.of(TAG), traffic.of(PHASE_TAGS[phase])
    # the forward's dispatch and the backward's combine gradient bring rows to the experts
    arrives = {"dispatch": (True, False), "combine": (False, True)}[phase]
    forward, backward = (_phase_timer(record, clock, arrival) for arrival in arrives)

    @tf.custom_gradient
    def sent(rows):
        received_counts, (received, *others) = exchange(
            comm, counts, [rows, *extra], exchanges, expected, timed=forward
        )
        arrived["counts"] = received_counts
        if others:
            arrived["expert"] = others[0]

        def gradient(upstream):  # a gather's gradient arrives as row slices: made dense
            upstream = tf.convert_to_tensor(upstream)
            _, (back,) = exchange(
                comm, received_counts, [upstream], exchanges, counts, timed=backward
            )
            return back

        return received, gradient

    return sent(rows)
