"""Jobs that `hyparflow run` relaunches (tests/test_elastic.py): each launch resumes with
`hf.fit(..., resume=True)`, and the launch that completes compares its weights with Keras's.

Usage (under `hyparflow run`): `python -m tests.mpi.elastic OUT MODE STRATEGY FOLDER`
  node_loss  3 epochs of 8 steps, a checkpoint every 4 steps; on the first launch the ranks of
             node B write their pids to $HF_NODE_PIDS after step 10 and wait to be killed
  preempt    3 epochs of 8 steps, checkpoints only at epoch ends and preemption; each rank
             writes its pid to $HF_RANK_PIDS and every step takes 0.25 s more, so the test
             can signal it mid-epoch
STRATEGY: auto (strategy="auto"), pipeline (hf.Strategy(partitions=2)) or tensor
(hf.Strategy(tensor=2)). Rank 0 appends each step it trains to FOLDER/steps.jsonl: the launch
(HYPARFLOW_RESTART), the layout, epoch, batch and time.
"""

import json
import os
import time

import keras
from mpi4py import MPI

import hyparflow as hf
from tests.mpi.nodes import StopNode, mlp
from tests.support.compare import relative_difference
from tests.support.models import data
from tests.support.report import args, report

EPOCHS, BATCH, SAMPLES = 3, 8, 64  # 8 steps an epoch
STRATEGIES = {
    "auto": lambda: "auto",
    "pipeline": lambda: hf.Strategy(partitions=2),
    "tensor": lambda: hf.Strategy(tensor=2),
}


def layout(model) -> list[int]:
    """The (partitions, replicas, tensor) hf.fit resolved for `model`."""
    grid = model._hyparflow_trainer[1].topology.grid
    return [grid.partitions, grid.replicas, grid.tensor]


class StepLog(keras.callbacks.Callback):
    """Rank 0 appends one line per trained step to `path`."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.epoch, self.layout = path, 0, None

    def on_train_begin(self, logs=None):
        self.layout = layout(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if hf.rank() != 0:
            return
        line = {
            "restart": int(os.environ.get("HYPARFLOW_RESTART", "-1")),
            "layout": self.layout,
            "epoch": self.epoch,
            "batch": batch,
            "time": time.time(),
        }
        with open(self.path, "a") as file:
            file.write(json.dumps(line) + "\n")


class Pace(keras.callbacks.Callback):
    """Each step takes `seconds` more, so a signal can land in the middle of an epoch."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def write_pid(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{MPI.COMM_WORLD.Get_rank()}.pid")
    with open(path + ".tmp", "w") as file:
        file.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def main():
    mode, strategy, folder = args()
    keras.config.disable_interactive_logging()
    x, y = data("mlp", n=SAMPLES)
    callbacks = [StepLog(os.path.join(folder, "steps.jsonl"))]
    if mode == "node_loss":
        checkpoint = hf.callbacks.Checkpoint(os.path.join(folder, "ckpt"), every_n_steps=4)
        if os.environ.get("HYPARFLOW_RESTART") == "0":
            callbacks.append(StopNode("nodeB", 10, os.environ["HF_NODE_PIDS"]))
    else:
        checkpoint = hf.callbacks.Checkpoint(os.path.join(folder, "ckpt"))
        write_pid(os.environ["HF_RANK_PIDS"])
        callbacks.append(Pace(0.25))
    model = mlp()
    history = hf.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        strategy=STRATEGIES[strategy](),
        callbacks=[*callbacks, checkpoint],
        resume=True,
        watchdog_timeout=60,
    )
    reference = mlp()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    report(
        {
            "layout": layout(model),
            "restart": int(os.environ.get("HYPARFLOW_RESTART", "-1")),
            "epochs": history.epoch,
            "weights": relative_difference(model.get_weights(), reference.get_weights()),
        }
    )


if __name__ == "__main__":
    main()
