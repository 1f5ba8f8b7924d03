"""Which world rank takes which place of the grid, from the node each rank runs on.

The grid numbers its places shard-innermost, then stage, then replica (`Grid.rank_of`): a
stage's tensor group, then a pipeline, are neighbours in that order. Dealing the places to
ranks sorted node by node keeps each tensor group on one node (its allreduces come in every
layer; Megatron-LM, Shoeybi et al. 2019, section 3), then a pipeline's neighbouring stages
together, and spreads a stage's replicas over the nodes (their gradient allreduce is one per
step). A launcher that fills nodes in rank order (`mpirun`'s default `--map-by slot`, Slurm's
block distribution) already gives that order, and the placement is the identity; round-robin
mappings (`--map-by node`, `srun -m cyclic`) get reordered.

Pure logic: the node of each rank comes from MPI's `COMM_TYPE_SHARED` (`topology.node_map`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hyparflow.comm.topology import Grid


def place(nodes: Sequence[int], grid: Grid) -> list[int]:
    """The world rank at each place of `grid`, `nodes[r]` being the node of world rank `r`.

    Tensor groups are cut inside one node wherever the node has room for a whole group; the
    ranks left over on nodes (when a node's rank count is not a multiple of the group size)
    form the last groups. Groups then follow node by node, so a pipeline's stages share a node
    where the node holds the whole pipeline, and replicas land on different nodes.

    Example:
        >>> place([0, 1, 0, 1], Grid(partitions=2, replicas=2))  # mpirun --map-by node
        [0, 2, 1, 3]
        >>> place([0, 0, 1, 1], Grid(partitions=2, replicas=2))  # by slot: unchanged
        [0, 1, 2, 3]
    """
    if len(nodes) != grid.size:
        raise ValueError(f"{len(nodes)} ranks cannot fill a grid of {grid.size} places")
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    groups, leftovers = [], []
    for node in sorted(by_node, key=lambda n: by_node[n][0]):  # nodes in order of first rank
        ranks = by_node[node]
        whole = len(ranks) - len(ranks) % grid.tensor
        groups += [ranks[i : i + grid.tensor] for i in range(0, whole, grid.tensor)]
        leftovers += ranks[whole:]
    groups += [leftovers[i : i + grid.tensor] for i in range(0, len(leftovers), grid.tensor)]
    return [rank for group in groups for rank in group]


def describe(order: Sequence[int], names: Sequence[str], grid: Grid) -> str:
    """One line per node naming its ranks' places, `names[r]` being world rank r's node.

    Example:
        >>> print(describe([0, 2, 1, 3], ["a", "b", "a", "b"], Grid(2, 2)))
        a: rank 0 stage 0 replica 0, rank 2 stage 1 replica 0
        b: rank 1 stage 0 replica 1, rank 3 stage 1 replica 1
    """
    lines: dict[str, list[str]] = {}
    for position, rank in enumerate(order):
        stage, replica, shard = grid.coords3(position)
        where = f"rank {rank} stage {stage} replica {replica}"
        if grid.tensor > 1:
            where += f" shard {shard}"
        lines.setdefault(names[rank], []).append(where)
    return "\n".join(f"{node}: {', '.join(places)}" for node, places in lines.items())


def crossings(
    order: Sequence[int], nodes: Sequence[int], grid: Grid, experts: int = 1
) -> dict[str, int]:
    """How many tensor groups, pipeline links and stage replica sets span nodes (for plans
    and tests: placement aims at none for the first two and as many as possible for the last);
    with `experts` > 1, also how many expert groups (`experts` consecutive replicas of a stage
    and shard, moe/expert_shards.py) do, which the grid's order keeps inside a node wherever a
    node holds whole groups: their all-to-alls come in every mixture layer.

    Example:
        >>> crossings([0, 2, 1, 3], [0, 1, 0, 1], Grid(2, 2))
        {'tensor_groups': 0, 'pipeline_links': 0, 'replica_sets': 2}
        >>> crossings([0, 1, 2, 3], [0, 0, 1, 1], Grid(1, 4), experts=2)["expert_groups"]
        0
    """
    node_at = [nodes[rank] for rank in order]
    tensor = sum(
        len({node_at[p] for p in grid.tensor_ranks(s, q)}) > 1
        for s in range(grid.partitions)
        for q in range(grid.replicas)
    )
    links = sum(
        node_at[grid.rank_of(s, q, t)] != node_at[grid.rank_of(s + 1, q, t)]
        for s in range(grid.partitions - 1)
        for q in range(grid.replicas)
        for t in range(grid.tensor)
    )
    replicas = sum(
        len({node_at[p] for p in grid.stage_ranks(s, t)}) > 1
        for s in range(grid.partitions)
        for t in range(grid.tensor)
    )
    found = {"tensor_groups": tensor, "pipeline_links": links, "replica_sets": replicas}
    if experts > 1:
        found["expert_groups"] = sum(
            len({node_at[p] for p in grid.expert_group_ranks(s, g, experts, t)}) > 1
            for s in range(grid.partitions)
            for t in range(grid.tensor)
            for g in range(grid.replicas // experts)
        )
    return found


def placement_table(names: Sequence[str], grid: Grid) -> list[dict]:
    """Each world rank's node and grid place once `place` has dealt them, in rank order:
    `names[r]` is world rank r's host (what `hyparflow plan --hosts` prints).

    Example:
        >>> placement_table(["a", "b"], Grid(1, 2))[1]
        {'rank': 1, 'node': 'b', 'stage': 0, 'replica': 1, 'shard': 0}
    """
    index: dict[str, int] = {}
    order = place([index.setdefault(name, len(index)) for name in names], grid)
    rows = []
    for position, rank in enumerate(order):
        stage, replica, shard = grid.coords3(position)
        rows.append(
            {"rank": rank, "node": names[rank], "stage": stage, "replica": replica, "shard": shard}
        )
    return sorted(rows, key=lambda row: row["rank"])
