"""Everything that touches MPI: the rank grid, point-to-point moves and gradient reduction."""

from hyparflow.comm.world import rank, size, world

__all__ = ["rank", "size", "world"]
