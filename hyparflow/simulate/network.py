"""Time to move bytes: Hockney latency/bandwidth links and MPI allreduce algorithm costs.

A message of `n` bytes over a link costs `alpha + n / beta` (Hockney, "The communication
challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994), plus a
per-message CPU overhead `o` on each side as in LogP (Culler et al., PPoPP 1993). Allreduce
costs follow Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005, whose model adds `gamma`, the time per byte of the
local reduction arithmetic; the library is assumed to pick the fastest of its algorithms for
each size, as MPICH and Open MPI do with their size-based selection rules.

Pure Python: no MPI, no TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Link:
    """One point-to-point path: `latency` seconds (alpha) and `bandwidth` bytes/s (beta).

    Example:
        >>> Link(latency=2e-6, bandwidth=10e9).time(10_000_000)
        0.001002
    """

    latency: float
    bandwidth: float

    def __post_init__(self):
        if self.latency < 0 or not self.bandwidth > 0:
            raise ValueError(
                f"a link needs latency >= 0 and bandwidth > 0, got {self.latency}, {self.bandwidth}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds for one message of `nbytes` to arrive: `latency + nbytes / bandwidth`."""
        return self.latency + nbytes / self.bandwidth

    def shared(self, flows: int) -> Link:
        """This link with its bandwidth split evenly among `flows` simultaneous transfers."""
        return replace(self, bandwidth=self.bandwidth / max(1, flows))

    def to_dict(self) -> dict:
        return {"latency": self.latency, "bandwidth": self.bandwidth}


def ring_allreduce(nbytes: float, ranks: int, link: Link, reduce_rate: float = math.inf) -> float:
    """Reduce-scatter then allgather around a ring: `2(p-1) alpha + 2 (p-1)/p n/beta +
    (p-1)/p n/reduce_rate` (bandwidth-optimal; Patarasuk and Yuan, JPDC 69(2), 2009).

    Example:
        >>> round(ring_allreduce(8e6, 4, Link(1e-6, 1e9)), 9)
        0.012006
    """
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return (
        2 * (ranks - 1) * link.latency
        + 2 * share * nbytes / link.bandwidth
        + (share * nbytes / reduce_rate)
    )


def recursive_doubling_allreduce(
    nbytes: float, ranks: int, link: Link, reduce_rate: float = math.inf
) -> float:
    """Exchange whole vectors with partners at distance 1, 2, 4, ...:
    `ceil(log2 p) (alpha + n/beta + n/reduce_rate)` (latency-optimal, for short messages).

    Example:
        >>> round(recursive_doubling_allreduce(8, 8, Link(1e-6, 1e9)), 12)
        3.024e-06
    """
    if ranks <= 1:
        return 0.0
    rounds = math.ceil(math.log2(ranks))
    return rounds * (link.latency + nbytes / link.bandwidth + nbytes / reduce_rate)


def rabenseifner_allreduce(
    nbytes: float, ranks: int, link: Link, reduce_rate: float = math.inf
) -> float:
    """Reduce-scatter by recursive halving, allgather by recursive doubling:
    `2 ceil(log2 p) alpha + 2 (p-1)/p n/beta + (p-1)/p n/reduce_rate`.

    Example:
        >>> round(rabenseifner_allreduce(8e6, 4, Link(1e-6, 1e9)), 9)
        0.012004
    """
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    rounds = math.ceil(math.log2(ranks))
    return (
        2 * rounds * link.latency
        + 2 * share * nbytes / link.bandwidth
        + (share * nbytes / reduce_rate)
    )


def latency_steps(algorithm: str, ranks: int) -> int:
    """Messages on the critical path of `algorithm` (how many latencies it pays).

    Example:
        >>> latency_steps("ring", 4), latency_steps("rabenseifner", 4)
        (6, 4)
    """
    if ranks <= 1:
        return 0
    rounds = math.ceil(math.log2(ranks))
    return {"ring": 2 * (ranks - 1), "rabenseifner": 2 * rounds}.get(algorithm, rounds)


ALLREDUCE_ALGORITHMS = {
    "ring": ring_allreduce,
    "recursive doubling": recursive_doubling_allreduce,
    "rabenseifner": rabenseifner_allreduce,
}


def allreduce(
    nbytes: float, ranks: int, link: Link, reduce_rate: float = math.inf
) -> tuple[float, str]:
    """Seconds of the fastest allreduce algorithm for this size, and its name.

    Example:
        >>> allreduce(8, 8, Link(1e-6, 1e9))[1], allreduce(8e6, 8, Link(1e-6, 1e9))[1]
        ('recursive doubling', 'rabenseifner')
    """
    if ranks <= 1:
        return 0.0, "none"
    times = {name: f(nbytes, ranks, link, reduce_rate) for name, f in ALLREDUCE_ALGORITHMS.items()}
    name = min(times, key=times.get)
    return times[name], name


def broadcast(nbytes: float, ranks: int, link: Link) -> float:
    """Seconds of a binomial-tree broadcast of a short message, as MPI runs one: ceil(log2 p)
    rounds of one message (Thakur, Rabenseifner and Gropp 2005).

    Example:
        >>> broadcast(8, 4, Link(1e-6, 1e9)), broadcast(8, 1, Link(1e-6, 1e9))
        (2.016e-06, 0.0)
    """
    if ranks <= 1:
        return 0.0
    return math.ceil(math.log2(ranks)) * link.time(nbytes)


def bucketed_allreduce(
    nbytes: float,
    ranks: int,
    link: Link,
    reduce_rate: float = math.inf,
    bucket_bytes: float = 25 * 2**20,
) -> float:
    """Seconds to reduce `nbytes` of gradients fused into buckets of `bucket_bytes`, one
    allreduce each, one after another (they share the same link, so they add up).

    Example:
        >>> round(bucketed_allreduce(60e6, 2, Link(0.0, 1e9), bucket_bytes=25e6), 6)
        0.06
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    full, rest = divmod(nbytes, bucket_bytes)
    total = full * allreduce(bucket_bytes, ranks, link, reduce_rate)[0]
    if rest > 0:
        total += allreduce(rest, ranks, link, reduce_rate)[0]
    return total


@dataclass(frozen=True)
class Network:
    """Links inside a node and between nodes, plus the costs MPI and hyparflow add per message.

    - `intra`: between ranks on one node (shared memory); `inter`: between nodes (the NIC,
      whose bandwidth the ranks of a node share when they talk off-node at the same time).
    - `reduce_rate`: bytes/s of the reduction arithmetic inside allreduce (1/gamma).
    - `overhead`: CPU seconds the sender spends posting a point-to-point message (LogP's `o`).
    - `handoff`, `handoff_bandwidth`: what a pipeline message adds to the critical path
      beyond the link's latency inside a node: a fixed part (the waiting receiver noticing
      it, wrapping the buffers as tensors) and the bytes at the rate the engine really moves
      them (measured on the engine's own transfers; the link's bandwidth if not measured).
    - `oversubscribed_latency`, `oversubscribed_collective_latency`: what a pipeline message,
      and each step of an allreduce, waits for the operating system to run the rank it
      needs when a node has more ranks than cores (scheduling, not wires; measured apart
      because a waiting pipeline rank yields its core at once, a reducing one does not).
      The pipeline message's wait is measured while other ranks compute and call MPI every
      few microseconds, which yields (microseconds); `oversubscribed_wakeup` is the wait
      beside ranks that do not.
    - `oversubscribed_wakeup`: the mean wait of a rank whose message arrives while another
      rank computes on its core without letting go (TensorFlow's calls do not yield): the
      scheduler takes the core from it at its next tick (`sharing.wake_wait`).
    - `oversubscribed_idle_share`: the share of a core a rank waiting in MPI still takes
      from computing ones on an oversubscribed node, as a fraction of a computing rank's
      claim (Open MPI yields between polls there: 0 if it took nothing, 1 if it spun).
    - `copy_rate`: bytes/s at which hyparflow copies gradients into its fusion buckets;
      `per_tensor`: seconds per gradient tensor it handles (copying in, wrapping out).
    - `loop_first`, `loop_last`, `loop_unpartitioned`: processor seconds per step a rank
      spends in the training loop outside compiled calls and waits (cutting its
      micro-batches, tracking the loss, the fit loop and callbacks), on a pipeline's first
      and last stage and on an unpartitioned model's rank (`loop_work`).

    Example:
        >>> net = Network(intra=Link(1e-6, 10e9), inter=Link(2e-6, 12e9))
        >>> net.link(crosses_nodes=True).bandwidth
        12000000000.0
    """

    intra: Link
    inter: Link | None = None
    reduce_rate: float = math.inf
    overhead: float = 0.0
    handoff: float = 0.0
    handoff_bandwidth: float = math.inf
    oversubscribed_latency: float = 0.0
    oversubscribed_collective_latency: float = 0.0
    oversubscribed_idle_share: float = 1.0
    oversubscribed_wakeup: float = 0.0
    copy_rate: float = math.inf
    per_tensor: float = 0.0
    loop_first: float = 0.0
    loop_last: float = 0.0
    loop_unpartitioned: float = 0.0
    source: dict = field(default_factory=dict, compare=False)  # how it was obtained

    def loop_work(self, stage: int, stages: int) -> float:
        """The training loop's work per step on a rank of `stage` of `stages`: measured on
        the first and last stage and without partitions; a middle stage, which cuts neither
        inputs nor targets and tracks no loss, does the smaller of the first and last's.

        Example:
            >>> net = Network(Link(1e-6, 1e10), loop_first=4e-4, loop_last=9e-4)
            >>> [net.loop_work(s, 4) for s in range(4)]
            [0.0004, 0.0004, 0.0004, 0.0009]
        """
        if stages == 1:
            return self.loop_unpartitioned
        if stage == 0:
            return self.loop_first
        if stage == stages - 1:
            return self.loop_last
        return min(self.loop_first, self.loop_last)

    def link(self, crosses_nodes: bool) -> Link:
        """The link between two ranks: `inter` when they are on different nodes."""
        if not crosses_nodes:
            return self.intra
        if self.inter is None:
            raise ValueError(
                "this layout spans several nodes but the network has no inter-node link; "
                "give one (e.g. --latency 2e-6 --bandwidth 12e9)"
            )
        return self.inter

    def p2p(self, nbytes: float, crosses_nodes: bool) -> float:
        """Wire time of one point-to-point message (without the CPU `overhead`)."""
        return self.link(crosses_nodes).time(nbytes)

    def pipeline_transfer(
        self,
        nbytes: float,
        crosses_nodes: bool,
        cpu_slowdown: float = 1.0,
        crowded: bool | None = None,
    ) -> float:
        """From a stage posting a micro-batch's tensors to the waiting neighbour holding them:
        handoff plus wire; inside a node both are processor work, stretched by
        `cpu_slowdown`, plus a scheduling wait when ranks outnumber cores (`crowded`; by
        default whenever `cpu_slowdown > 1`)."""
        if crosses_nodes:
            return self.handoff * cpu_slowdown + self.p2p(nbytes, True)
        crowded = cpu_slowdown > 1 if crowded is None else crowded
        busy = self.oversubscribed_latency if crowded else 0.0
        rate = min(self.intra.bandwidth, self.handoff_bandwidth)
        wire = self.intra.latency + nbytes / rate
        return (self.handoff + wire) * cpu_slowdown + busy

    def gradient_allreduce(
        self,
        nbytes: float,
        ranks: int,
        crosses_nodes: bool,
        flows: int = 1,
        cpu_slowdown: float = 1.0,
        tensors: int = 0,
        in_place: bool = False,
        crowded: bool | None = None,
    ) -> float:
        """hyparflow's fused gradient sum of `tensors` gradients: copy into buckets, then one
        allreduce per bucket over the intra- or inter-node link, whose bandwidth `flows`
        reductions share. `in_place`: the gradients already are one flat buffer (the
        data-parallel step's, packed inside its compiled call): no copies.

        `cpu_slowdown` stretches what the processors do (copies, reduction arithmetic, and
        inside a node the shared-memory transfers themselves) when ranks share cores; each
        step of the collective also waits for the scheduler when they outnumber the cores
        (`crowded`; by default whenever `cpu_slowdown > 1`).
        """
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(crosses_nodes).shared(flows)
        if not crosses_nodes:
            crowded = cpu_slowdown > 1 if crowded is None else crowded
            busy = self.oversubscribed_collective_latency if crowded else 0.0
            link = Link(link.latency * cpu_slowdown + busy, link.bandwidth / cpu_slowdown)
        copy = 0.0 if in_place else (nbytes / self.copy_rate + tensors * self.per_tensor)
        copy *= cpu_slowdown
        return copy + bucketed_allreduce(nbytes, ranks, link, self.reduce_rate / cpu_slowdown)

    def logs_sync(
        self,
        ranks: int,
        replicas: int,
        crosses_nodes: bool,
        cpu_slowdown: float = 1.0,
        crowded: bool | None = None,
    ) -> float:
        """The training loop's agreement after each step, a few bytes each: the last stage's
        replicas sum their metric states (`replicas`), the logs go from the last stage to
        every rank, and every rank says whether to stop (both over all `ranks`)."""
        link = self.link(crosses_nodes)
        crowded = cpu_slowdown > 1 if crowded is None else crowded
        busy = self.oversubscribed_collective_latency if crowded else 0.0
        link = Link(link.latency * cpu_slowdown + busy, link.bandwidth / cpu_slowdown)
        small = 64.0  # bytes: a pickled flag or a few floats
        return (
            allreduce(small, replicas, link)[0]
            + broadcast(small, ranks, link)
            + allreduce(small, ranks, link)[0]
        )

    def to_dict(self) -> dict:
        return {
            "intra": self.intra.to_dict(),
            "inter": None if self.inter is None else self.inter.to_dict(),
            "reduce_rate": _finite_or_none(self.reduce_rate),
            "overhead": self.overhead,
            "handoff": self.handoff,
            "handoff_bandwidth": _finite_or_none(self.handoff_bandwidth),
            "oversubscribed_latency": self.oversubscribed_latency,
            "oversubscribed_collective_latency": self.oversubscribed_collective_latency,
            "oversubscribed_idle_share": self.oversubscribed_idle_share,
            "oversubscribed_wakeup": self.oversubscribed_wakeup,
            "copy_rate": _finite_or_none(self.copy_rate),
            "per_tensor": self.per_tensor,
            "loop_first": self.loop_first,
            "loop_last": self.loop_last,
            "loop_unpartitioned": self.loop_unpartitioned,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Network:
        inter = data.get("inter")
        return cls(
            intra=Link(**data["intra"]),
            inter=None if inter is None else Link(**inter),
            reduce_rate=_none_to_inf(data.get("reduce_rate")),
            overhead=float(data.get("overhead", 0.0)),
            handoff=float(data.get("handoff", 0.0)),
            handoff_bandwidth=_none_to_inf(data.get("handoff_bandwidth")),
            oversubscribed_latency=float(data.get("oversubscribed_latency", 0.0)),
            oversubscribed_collective_latency=float(
                data.get("oversubscribed_collective_latency", 0.0)
            ),
            oversubscribed_idle_share=float(data.get("oversubscribed_idle_share", 1.0)),
            oversubscribed_wakeup=float(data.get("oversubscribed_wakeup", 0.0)),
            copy_rate=_none_to_inf(data.get("copy_rate")),
            per_tensor=float(data.get("per_tensor", 0.0)),
            loop_first=float(data.get("loop_first", 0.0)),
            loop_last=float(data.get("loop_last", 0.0)),
            loop_unpartitioned=float(data.get("loop_unpartitioned", 0.0)),
            source=dict(data.get("source", {})),
        )


def _finite_or_none(value: float):
    return None if math.isinf(value) else value


def _none_to_inf(value) -> float:
    return math.inf if value is None else float(value)
