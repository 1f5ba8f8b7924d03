"""Time to move bytes: Hockney latency/bandwidth links and MPI allreduce algorithm costs.

A message of `n` bytes over a link costs `alpha + n / beta` (Hockney, "The communication
challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994). Allreduce
costs follow Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005, whose model adds `gamma`, the time per byte of the
local reduction arithmetic; the library is assumed to pick the fastest of its algorithms for
each size, as MPICH and Open MPI do. Pure Python: no MPI, no TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace


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


def allreduce_times(
    nbytes: float, ranks: int, link: Link, reduce_rate: float = math.inf
) -> dict[str, float]:
    """Seconds of each allreduce algorithm for `p = ranks`, `n = nbytes`, `gamma = 1 /
    reduce_rate` (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan, JPDC 69(2), 2009):

    - ring: `2(p-1) alpha + 2 (p-1)/p n/beta + (p-1)/p n gamma` (bandwidth-optimal);
    - recursive doubling: `ceil(log2 p) (alpha + n/beta + n gamma)` (latency-optimal);
    - Rabenseifner (halving, then doubling): `2 ceil(log2 p) alpha + 2 (p-1)/p n/beta +
      (p-1)/p n gamma`.

    Example:
        >>> times = allreduce_times(8e6, 4, Link(1e-6, 1e9))
        >>> {name: round(t, 9) for name, t in times.items()}
        {'ring': 0.012006, 'recursive doubling': 0.016002, 'rabenseifner': 0.012004}
    """
    rounds, share = math.ceil(math.log2(ranks)), (ranks - 1) / ranks
    bulk = share * nbytes * (2 / link.bandwidth + 1 / reduce_rate)
    return {
        "ring": 2 * (ranks - 1) * link.latency + bulk,
        "recursive doubling": rounds
        * (link.latency + nbytes / link.bandwidth + nbytes / reduce_rate),
        "rabenseifner": 2 * rounds * link.latency + bulk,
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
    times = allreduce_times(nbytes, ranks, link, reduce_rate)
    name = min(times, key=times.get)
    return times[name], name


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
    return total + (allreduce(rest, ranks, link, reduce_rate)[0] if rest > 0 else 0.0)


@dataclass(frozen=True)
class Network:
    """Links inside a node (`intra`) and between nodes (`inter`: the NIC, whose bandwidth
    the ranks of a node share when they talk off-node at the same time), and the bytes/s of
    the reduction arithmetic inside allreduce (`reduce_rate`, 1/gamma).

    Example:
        >>> net = Network(intra=Link(1e-6, 10e9), inter=Link(2e-6, 12e9))
        >>> net.link(crosses_nodes=True).bandwidth
        12000000000.0
    """

    intra: Link
    inter: Link | None = None
    reduce_rate: float = math.inf
    source: dict = field(default_factory=dict, compare=False)  # how it was obtained

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

    def gradient_allreduce(self, nbytes: float, ranks: int, crosses_nodes: bool, flows=1) -> float:
        """hyparflow's sum of `nbytes` of gradients in 25 MiB buckets over the intra- or
        inter-node link, whose bandwidth `flows` reductions share."""
        link = self.link(crosses_nodes).shared(flows)
        return bucketed_allreduce(nbytes, ranks, link, self.reduce_rate)

    def logs_sync(self, ranks: int, replicas: int, crosses_nodes: bool) -> float:
        """The training loop's agreement after each step, a few bytes each: the last stage's
        replicas sum their metric states (`replicas`), the logs go from the last stage to
        every rank, and every rank says whether to stop (both over all `ranks`)."""
        link, small = self.link(crosses_nodes), 64.0  # bytes: a flag or a few floats
        broadcast = math.ceil(math.log2(ranks)) * link.time(small)  # a binomial tree
        return allreduce(small, replicas, link)[0] + broadcast + allreduce(small, ranks, link)[0]

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["intra"] = vars(self.intra)
        data["inter"] = None if self.inter is None else vars(self.inter)
        return {k: None if v == math.inf else v for k, v in data.items()}

    @classmethod
    def from_dict(cls, data: dict) -> Network:
        """From `to_dict`'s output or `netbench`'s; unknown keys (older files) are ignored."""
        names = {f.name for f in fields(cls)} - {"intra", "inter", "source"}
        values = {k: float(v) for k, v in data.items() if k in names and v is not None}
        inter = data.get("inter")
        return cls(
            Link(**data["intra"]),
            inter and Link(**inter),
            **values,
            source=dict(data.get("source", {})),
        )
