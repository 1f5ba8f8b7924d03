"""A job's layout, and which node each rank of its (stage, replica) grid lands on.

The engine numbers grid places `replica * partitions + stage` (`comm.topology.Grid`) and deals
them to ranks node by node (`comm.placement.place`), so place `r` sits on node
`r // ranks_per_node`: a pipeline's stages share a node when it is wide enough, and the
replicas of one stage are spread over nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyparflow.comm.topology import Grid


@dataclass(frozen=True)
class Layout:
    """HyPar-Flow's partitions and replicas, the pipeline's micro-batches and schedule (with
    `virtual_stages` model chunks per stage when interleaved), and how many ranks fill a node
    (None: one node for all).

    Example:
        >>> where = Layout(partitions=4, replicas=2, ranks_per_node=2)
        >>> where.nodes, where.pipeline_link_crosses_nodes(1), where.stage_nodes(0)
        (4, True, 2)
    """

    partitions: int = 1
    replicas: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    ranks_per_node: int | None = None
    virtual_stages: int = 1

    def __post_init__(self):
        if self.ranks_per_node is not None and (
            not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be an int >= 1, got {self.ranks_per_node!r}")

    @property
    def chunks(self) -> int:
        """Model chunks per stage: `virtual_stages` when interleaved, else 1."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    @property
    def world(self) -> int:
        return self.partitions * self.replicas

    @property
    def per_node(self) -> int:
        """Ranks on the fullest node."""
        return min(self.world, self.ranks_per_node or self.world)

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def pipeline_link_crosses_nodes(self, stage: int) -> bool:
        """Whether stage `stage` and the next are on different nodes in any replica (the last
        stage's next is the first: an interleaved model's next chunk)."""
        grid, following = Grid(self.partitions, self.replicas), (stage + 1) % self.partitions
        return any(
            self.node_of(grid.rank_of(stage, q)) != self.node_of(grid.rank_of(following, q))
            for q in range(self.replicas)
        )

    def stage_nodes(self, stage: int) -> int:
        """Number of nodes the replicas of `stage` span (its allreduce crosses nodes if > 1)."""
        ranks = Grid(self.partitions, self.replicas).stage_ranks(stage)
        return len({self.node_of(r) for r in ranks})

    def offnode_reductions_per_node(self) -> int:
        """Most stage allreduces that leave one node: each stage with a rank on the node whose
        replicas span several nodes sends one flow through the node's network interface (a
        ring ordered by rank enters and leaves each node once), and all stages reduce at
        about the same time, at the end of the pipeline."""
        spanning = {s for s in range(self.partitions) if self.stage_nodes(s) > 1}
        stages_on = [set() for _ in range(self.nodes)]
        for rank in range(self.world):
            if rank % self.partitions in spanning:
                stages_on[self.node_of(rank)].add(rank % self.partitions)
        return max(len(stages) for stages in stages_on)
