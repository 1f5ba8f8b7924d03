"""hyparflow: data, model (pipeline) and hybrid parallel training of Keras 3 models over MPI."""

from hyparflow.api import fit
from hyparflow.comm.world import rank, size
from hyparflow.strategy import Strategy

__version__ = "0.1.0"

__all__ = ["Strategy", "fit", "rank", "size", "__version__"]
