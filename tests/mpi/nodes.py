"""Training across emulated nodes (tests/support/nodes.py) under a real mpirun.

Usage: `python -m tests.mpi.nodes OUT MODE ...` with MODE one of
  cases CASES...   each case (JSON, tests/support/cases.py) against Keras, by the equivalence
                   or real-model scenario
  wiring LOG_DIR   a profiled hybrid fit (2 stages x 2 replicas), then a message between every
                   pair of ranks; this rank's host and its TCP peers' addresses
(A lost node, relaunched on the one left: tests/mpi/elastic.py, which uses `StopNode`.)
"""

import json
import os
import socket
import time

import keras
import psutil
from mpi4py import MPI

import hyparflow as hf
from tests.mpi import equivalence, real_models
from tests.mpi.reliability import model_with_dropout
from tests.support.cases import Case
from tests.support.models import data
from tests.support.report import args, report, run_or_abort

BATCH, SAMPLES = 16, 64


def mlp():
    """tests/mpi/reliability.py's model, without dropout: its masks would differ between the
    killed launch's layout and the relaunch's (tests/mpi/elastic.py)."""
    return model_with_dropout(0.0)


class StopNode(keras.callbacks.Callback):
    """After global batch `after`, the ranks of `node` hand their pids to the test and wait to
    be killed with their node."""

    def __init__(self, node: str, after: int, folder: str):
        super().__init__()
        self.node, self.after, self.folder, self.seen = node, after, folder, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.after and socket.gethostname() == self.node:
            os.makedirs(self.folder, exist_ok=True)
            path = os.path.join(self.folder, f"{hf.rank()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "daemon": os.getppid()}, f)
            os.replace(path + ".tmp", path)
            time.sleep(600)


def tcp_peers() -> list[str]:
    """Remote addresses of this process's established TCP connections."""
    connections = psutil.Process().net_connections(kind="tcp")
    return sorted({c.raddr.ip for c in connections if c.status == psutil.CONN_ESTABLISHED})


def main():
    mode, *rest = args()
    keras.config.disable_interactive_logging()
    x, y = data("mlp", n=SAMPLES)
    if mode == "cases":
        results = []
        for text in rest:
            case = Case.from_json(text)
            runner = real_models if case.tensor > 1 else equivalence
            results.append(runner.run(case))
        report({"results": results})
    elif mode == "wiring":
        (log_dir,) = rest
        hf.fit(
            mlp(),
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            verbose=0,
            strategy=hf.Strategy("hybrid", partitions=2, replicas=2, microbatches=2),
            callbacks=[hf.callbacks.ScalingProfiler(log_dir, timeline=False)],
        )
        # every pair of ranks exchanges a message, so Open MPI wires up every transport
        # (lazily: a peer on another node gets its TCP connection at the first message)
        hosts = MPI.COMM_WORLD.alltoall([socket.gethostname()] * MPI.COMM_WORLD.Get_size())
        report({"host": socket.gethostname(), "hosts": hosts, "tcp_peers": tcp_peers()})


if __name__ == "__main__":
    run_or_abort(main)
