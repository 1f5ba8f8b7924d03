"""Which node each rank of the (stage, replica) grid lands on, and so which links it uses.

The engine numbers ranks `replica * partitions + stage` (`comm.topology.Grid`), and a launcher
fills nodes in rank order (`mpirun --map-by core`, Slurm's block distribution), so rank `r`
sits on node `r // ranks_per_node`: a pipeline's stages share a node when it is wide enough,
and the replicas of one stage are spread over nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyparflow.comm.topology import Grid


@dataclass(frozen=True)
class Placement:
    """`partitions x replicas` ranks, `ranks_per_node` to a node, filled in rank order.

    Example:
        >>> where = Placement(partitions=4, replicas=2, ranks_per_node=2)
        >>> where.nodes, where.pipeline_link_crosses_nodes(1), where.stage_nodes(0)
        (4, True, 2)
    """

    partitions: int
    replicas: int
    ranks_per_node: int

    def __post_init__(self):
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be an int >= 1, got {self.ranks_per_node!r}")

    @property
    def grid(self) -> Grid:
        return Grid(self.partitions, self.replicas)

    @property
    def world(self) -> int:
        return self.partitions * self.replicas

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_on_node(self, node: int) -> int:
        """How many ranks node `node` holds (the last node may be partly filled)."""
        first = node * self.ranks_per_node
        return max(0, min(self.world, first + self.ranks_per_node) - first)

    @property
    def busiest_node_ranks(self) -> int:
        return max(self.ranks_on_node(n) for n in range(self.nodes))

    def pipeline_link_crosses_nodes(self, stage: int) -> bool:
        """Whether stage `stage` and stage `stage + 1` are on different nodes in any replica."""
        grid = self.grid
        return any(
            self.node_of(grid.rank_of(stage, q)) != self.node_of(grid.rank_of(stage + 1, q))
            for q in range(self.replicas)
        )

    def stage_nodes(self, stage: int) -> int:
        """Number of nodes the replicas of `stage` span (its allreduce crosses nodes if > 1)."""
        return len({self.node_of(r) for r in self.grid.stage_ranks(stage)})

    def stage_node_ranks(self) -> list[dict[int, int]]:
        """For each stage, how many of its replicas each node holds."""
        counts = []
        for stage in range(self.partitions):
            nodes = [self.node_of(rank) for rank in self.grid.stage_ranks(stage)]
            counts.append({node: nodes.count(node) for node in sorted(set(nodes))})
        return counts

    def offnode_reductions_per_node(self) -> int:
        """Most stage allreduces that leave one node: each stage with a rank on the node whose
        replicas span several nodes sends one flow through the node's network interface (a
        ring ordered by rank enters and leaves each node once), and all stages reduce at
        about the same time, at the end of the pipeline."""
        spanning = {s for s in range(self.partitions) if self.stage_nodes(s) > 1}
        stages_on = [set() for _ in range(self.nodes)]
        for rank in range(self.world):
            stage = rank % self.partitions
            if stage in spanning:
                stages_on[self.node_of(rank)].add(stage)
        return max(len(stages) for stages in stages_on)
