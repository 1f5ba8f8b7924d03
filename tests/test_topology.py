"""The rank grid, without MPI: placement, coordinates and validation."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyparflow.comm import topology
from hyparflow.comm.topology import Grid


def test_pipeline_stages_are_rank_neighbours():
    grid = Grid(partitions=3, replicas=2)
    assert grid.size == 6
    assert grid.pipeline_ranks(0) == [0, 1, 2] and grid.pipeline_ranks(1) == [3, 4, 5]
    assert grid.stage_ranks(1) == [1, 4]
    assert grid.coords(4) == (1, 1) and grid.rank_of(2, 1) == 5


@given(st.integers(1, 8), st.integers(1, 8))
def test_coords_and_rank_of_are_inverse_bijections(partitions, replicas):
    grid = Grid(partitions, replicas)
    coords = [grid.coords(rank) for rank in range(grid.size)]
    assert len(set(coords)) == grid.size
    assert all(grid.rank_of(*c) == rank for rank, c in enumerate(coords))
    all_pipelines = sorted(r for rep in range(replicas) for r in grid.pipeline_ranks(rep))
    assert all_pipelines == list(range(grid.size))


def test_invalid_grids_and_coordinates_raise_clear_errors():
    with pytest.raises(ValueError, match="partitions must be an int >= 1"):
        Grid(0, 2)
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        Grid(2, 1.5)
    grid = Grid(2, 2)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        grid.coords(4)
    with pytest.raises(ValueError, match="stage 2 is outside"):
        grid.rank_of(2, 0)
    with pytest.raises(ValueError, match="replica -1 is outside"):
        grid.rank_of(0, -1)


class FakeComm:
    """Just enough of a communicator for the size check, which happens before any split."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0


def test_topology_refuses_a_world_of_the_wrong_size():
    with pytest.raises(ValueError, match="3 ranks cannot form 2 partitions x 2 replicas = 4"):
        topology.Topology.create(FakeComm(3), partitions=2, replicas=2)
