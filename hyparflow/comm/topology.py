"""The rank grid (stage, replica, tensor shard) and the communicators built on it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hyparflow.comm.failure import watched


@dataclass(frozen=True)
class Grid:
    """`partitions` pipeline stages, each split over `tensor` ranks, times `replicas` copies.

    `rank_of(stage, replica, shard) = (replica * partitions + stage) * tensor + shard`: the
    `tensor` ranks that split one stage are innermost, so they are neighbours in rank order and
    on one node (Megatron-LM's convention: their allreduces come in every layer), and a
    pipeline's stages come next (stage-to-stage traffic is the next heaviest).

    Example:
        >>> grid = Grid(partitions=2, replicas=3)
        >>> grid.rank_of(stage=1, replica=2), grid.coords(5), grid.stage_ranks(0)
        (5, (1, 2), [0, 2, 4])
        >>> Grid(partitions=2, replicas=1, tensor=2).tensor_ranks(stage=1, replica=0)
        [2, 3]
    """

    partitions: int
    replicas: int
    tensor: int = 1

    def __post_init__(self):
        for name in ("partitions", "replicas", "tensor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Number of ranks the grid needs: `partitions * replicas * tensor`."""
        return self.partitions * self.replicas * self.tensor

    def rank_of(self, stage: int, replica: int, shard: int = 0) -> int:
        """Rank holding tensor shard `shard` of `stage` of pipeline `replica`."""
        if not 0 <= stage < self.partitions:
            raise ValueError(f"stage {stage} is outside 0..{self.partitions - 1}")
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} is outside 0..{self.replicas - 1}")
        if not 0 <= shard < self.tensor:
            raise ValueError(f"tensor shard {shard} is outside 0..{self.tensor - 1}")
        return (replica * self.partitions + stage) * self.tensor + shard

    def coords(self, rank: int) -> tuple[int, int]:
        """`(stage, replica)` of `rank`."""
        return self.coords3(rank)[:2]

    def coords3(self, rank: int) -> tuple[int, int, int]:
        """`(stage, replica, shard)` of `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the grid's 0..{self.size - 1}")
        group, shard = divmod(rank, self.tensor)
        replica, stage = divmod(group, self.partitions)
        return stage, replica, shard

    def pipeline_ranks(self, replica: int, shard: int = 0) -> list[int]:
        """Ranks of pipeline `replica` that hold tensor shard `shard`, first stage to last."""
        return [self.rank_of(stage, replica, shard) for stage in range(self.partitions)]

    def stage_ranks(self, stage: int, shard: int = 0) -> list[int]:
        """Ranks holding shard `shard` of `stage`, one per replica in replica order."""
        return [self.rank_of(stage, replica, shard) for replica in range(self.replicas)]

    def tensor_ranks(self, stage: int, replica: int) -> list[int]:
        """Ranks that split `stage` of pipeline `replica`, in shard order."""
        return [self.rank_of(stage, replica, shard) for shard in range(self.tensor)]

    def expert_group_ranks(self, stage: int, group: int, experts: int, shard: int = 0) -> list:
        """Ranks of expert group `group` of `stage`'s shard `shard` when `experts` replicas
        split the experts (`expert_group`), in position order."""
        replicas = range(group * experts, (group + 1) * experts)
        return [self.rank_of(stage, replica, shard) for replica in replicas]


def expert_group(replica: int, experts: int) -> tuple[int, int]:
    """(expert group, position in it) of `replica` when `experts` replicas of a stage split the
    mixture blocks' experts: consecutive replicas, which placement deals node by node, so a
    group lies inside a node wherever the node holds whole groups (placement.crossings)."""
    return divmod(replica, experts)


@dataclass
class Topology:
    """This rank's place in the grid and the communicators the engine talks over.

    - `pipeline_comm`: the ranks of my pipeline holding my tensor shard; its rank is my stage
      (activations, gradients).
    - `stage_comm`: my stage and shard across replicas; its rank is my replica (gradient
      reduction).
    - `tensor_comm`: the ranks that split my stage of my pipeline; its rank is my shard (the
      allreduces inside tensor-parallel layers). Of size 1 without tensor parallelism.
    - `prev_rank` / `next_rank`: my neighbours in `pipeline_comm`, None at the pipeline's ends.

    Example (world rank 2 of 4):
        topo = Topology.create(MPI.COMM_WORLD, partitions=2, replicas=2)
        topo.stage, topo.replica, topo.next_rank  # (0, 1, 1)
    """

    grid: Grid
    world: object
    rank: int
    pipeline_comm: object
    stage_comm: object
    tensor_comm: object = None
    nodes: list = None  # the node (host name) of each rank of `world`

    @classmethod
    def create(cls, comm, partitions: int, replicas: int, tensor: int = 1) -> Topology:
        """Split `comm` into the grid's communicators; collective over every rank of `comm`."""
        grid = Grid(partitions, replicas, tensor)
        if comm.Get_size() != grid.size:
            shards = f" x {tensor} tensor shards" if tensor > 1 else ""
            raise ValueError(
                f"{comm.Get_size()} ranks cannot form {partitions} partitions x {replicas} "
                f"replicas{shards} = {grid.size}; launch {grid.size} ranks or change the split"
            )
        rank = comm.Get_rank()
        stage, replica, shard = grid.coords3(rank)
        # Watched: a blocking collective on them leaves when a peer fails (comm/failure.py).
        pipeline_comm = watched(comm.Split(color=replica * tensor + shard, key=stage))
        stage_comm = watched(comm.Split(color=stage * tensor + shard, key=replica))
        tensor_comm = watched(comm.Split(color=replica * partitions + stage, key=shard))
        nodes = comm.allgather(_processor_name())
        return cls(grid, watched(comm), rank, pipeline_comm, stage_comm, tensor_comm, nodes)

    @property
    def node(self) -> str:
        """The node this rank runs on (MPI's processor name: the host name)."""
        return self.nodes[self.rank]

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    @property
    def stage(self) -> int:
        return self.grid.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.grid.coords(self.rank)[1]

    @property
    def shard(self) -> int:
        """My tensor shard: which slice of the stage's split layers this rank holds."""
        return self.grid.coords3(self.rank)[2]

    @property
    def num_shards(self) -> int:
        return self.grid.tensor

    @property
    def num_stages(self) -> int:
        return self.grid.partitions

    @property
    def num_replicas(self) -> int:
        return self.grid.replicas

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def prev_rank(self) -> int | None:
        """Previous stage's rank in `pipeline_comm` (activations come from it), or None."""
        return None if self.is_first_stage else self.stage - 1

    @property
    def next_rank(self) -> int | None:
        """Next stage's rank in `pipeline_comm` (activations go to it), or None."""
        return None if self.is_last_stage else self.stage + 1

    def free(self) -> None:
        """Release the sub-communicators (collective); the world communicator is not touched."""
        for comm in (self.pipeline_comm, self.stage_comm, self.tensor_comm):
            if comm is not None:
                comm.Free()
        self.pipeline_comm = self.stage_comm = self.tensor_comm = None


def _processor_name() -> str:
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    return MPI.Get_processor_name()


def node_map(comm) -> tuple[list[int], list[str]]:
    """(node index of each rank of `comm`, host name of each rank): ranks that share memory
    (`MPI_COMM_TYPE_SHARED`) are one node, numbered in order of their lowest rank. Collective.

    Example:
        nodes, names = node_map(MPI.COMM_WORLD)  # e.g. [0, 1, 0, 1], ["a", "b", "a", "b"]
    """
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = local.bcast(comm.Get_rank(), root=0)
    finally:
        local.Free()
    leaders, names = zip(*comm.allgather((leader, _processor_name())), strict=True)
    index = {lead: i for i, lead in enumerate(sorted(set(leaders)))}
    return [index[lead] for lead in leaders], list(names)


_PLACED: dict = {}


def placed(comm, grid: Grid):
    """`comm` with its ranks in grid order (`placement.place`): the same communicator where
    the launcher already put them so, else one made once by `Split` and kept for later calls.
    Collective over `comm`; the ranks must number `grid.size`.

    Example:
        comm = placed(MPI.COMM_WORLD, Grid(partitions=2, replicas=2))
        Topology.create(comm, 2, 2)  # comm's rank r takes grid place r
    """
    from hyparflow.comm.placement import describe, place

    if comm.Get_size() != grid.size:
        return comm  # Topology.create says what is wrong
    key = (comm.py2f(), grid)
    if key not in _PLACED:
        nodes, names = node_map(comm)
        order = place(nodes, grid)
        if order == list(range(grid.size)):
            _PLACED[key] = comm
        else:
            _PLACED[key] = comm.Split(0, key=order.index(comm.Get_rank()))
        if comm.Get_rank() == 0 and len(set(nodes)) > 1:
            reordered = "" if _PLACED[key] is comm else " (reordered from the launcher's)"
            logging.getLogger(__name__).info(
                "placement on %d nodes%s:\n%s",
                len(set(nodes)),
                reordered,
                describe(order, names, grid),
            )
    return _PLACED[key]
