"""An exception no code catches, under a real mpirun: the job must end, never hang.

Usage: `python -m tests.mpi.uncaught OUT MODE` with MODE one of
  one_rank   MPI started (`hf.rank()`); rank 1 raises (a missing file) while rank 0 enters
             `hf.fit` and waits for it in a collective
  agreed     every rank gets the same `hf.fit` error (an unknown strategy), uncaught: all exit
             with their traceback, and nobody calls MPI_Abort
Rank 0 reports only if it finishes training, which it must not in `one_rank`.
"""

import keras
import numpy as np

import hyparflow as hf
from tests.support.report import args, report


def train(strategy: str) -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    hf.fit(model, x, y, batch_size=8, epochs=2, strategy=strategy, verbose=0)


if __name__ == "__main__":
    (mode,) = args()
    if mode == "one_rank":
        if hf.rank() == 1:
            raise FileNotFoundError("data-rank1.npy: this node's copy of the data is missing")
        train("data")
    elif mode == "agreed":
        train("no_such_strategy")
    report({"rank": hf.rank(), "trained": True})
