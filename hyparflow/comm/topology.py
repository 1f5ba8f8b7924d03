"""The rank grid (stage, replica) and the pipeline and per-stage communicators built on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Grid:
    """`partitions` pipeline stages times `replicas` copies, laid out pipeline by pipeline.

    `rank_of(stage, replica) = replica * partitions + stage`, so a pipeline's stages are
    neighbours in rank order (and usually on one node, where stage-to-stage traffic is heavy).

    Example:
        >>> grid = Grid(partitions=2, replicas=3)
        >>> grid.rank_of(stage=1, replica=2), grid.coords(5), grid.stage_ranks(0)
        (5, (1, 2), [0, 2, 4])
    """

    partitions: int
    replicas: int

    def __post_init__(self):
        for name in ("partitions", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Number of ranks the grid needs: `partitions * replicas`."""
        return self.partitions * self.replicas

    def rank_of(self, stage: int, replica: int) -> int:
        """Rank holding `stage` of pipeline `replica`."""
        if not 0 <= stage < self.partitions:
            raise ValueError(f"stage {stage} is outside 0..{self.partitions - 1}")
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} is outside 0..{self.replicas - 1}")
        return replica * self.partitions + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """`(stage, replica)` of `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the grid's 0..{self.size - 1}")
        replica, stage = divmod(rank, self.partitions)
        return stage, replica

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Ranks of pipeline `replica`, first stage to last."""
        return [self.rank_of(stage, replica) for stage in range(self.partitions)]

    def stage_ranks(self, stage: int) -> list[int]:
        """Ranks holding `stage`, one per replica in replica order."""
        return [self.rank_of(stage, replica) for replica in range(self.replicas)]


@dataclass
class Topology:
    """This rank's place in the grid and the communicators the engine talks over.

    - `pipeline_comm`: the ranks of my pipeline; its rank is my stage (activations, gradients).
    - `stage_comm`: my stage across replicas; its rank is my replica (gradient reduction).
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

    @classmethod
    def create(cls, comm, partitions: int, replicas: int) -> Topology:
        """Split `comm` into the grid's communicators; collective over every rank of `comm`."""
        grid = Grid(partitions, replicas)
        if comm.Get_size() != grid.size:
            raise ValueError(
                f"{comm.Get_size()} ranks cannot form {partitions} partitions x {replicas} "
                f"replicas = {grid.size}; launch {grid.size} ranks or change the split"
            )
        rank = comm.Get_rank()
        stage, replica = grid.coords(rank)
        pipeline_comm = comm.Split(color=replica, key=stage)
        stage_comm = comm.Split(color=stage, key=replica)
        return cls(grid, comm, rank, pipeline_comm, stage_comm)

    @property
    def stage(self) -> int:
        return self.grid.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.grid.coords(self.rank)[1]

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
        for comm in (self.pipeline_comm, self.stage_comm):
            if comm is not None:
                comm.Free()
        self.pipeline_comm = self.stage_comm = None
