"""Weights held elsewhere while hf.fit trains (ZeRO-3's slices, tensor shards) when one rank
fails mid-epoch, in a launch of its own (`python -m tests.mpi.zero_failure OUT`), then another
hf.fit in the same processes: the failed one left a collective half-entered on its
communicator, and the next runs on a fresh one (`comm.world.loops_comm`).
"""

import keras
import numpy as np

import hyparflow as hf
from tests.mpi.zero import _held, _small_mlp, small_mlp_trained
from tests.support.compare import relative_difference
from tests.support.report import args, report


class _FailOnRank(keras.callbacks.Callback):
    """Raises on rank `rank` alone after `steps` steps, the others carrying on into the next."""

    def __init__(self, rank: int, steps: int):
        super().__init__()
        self.rank, self.steps = rank, steps

    def on_train_batch_end(self, batch, logs=None):
        if hf.rank() == self.rank and batch + 1 == self.steps:
            raise RuntimeError(f"injected failure after step {self.steps}")


class _HeldInSteps(keras.callbacks.Callback):
    """Records whether the model's weights hold values after each step (none while the slices
    or shards are the weights)."""

    def __init__(self):
        super().__init__()
        self.held = []

    def on_train_batch_end(self, batch, logs=None):
        self.held.append(_held(self.model))


def failed_step(strategy) -> dict:
    """`strategy` when one rank fails mid-epoch (rank 1, after 3 of 4 steps): every rank
    raises, and the variables, let go while training, take their values from the slices or
    shards: those of Keras's fit after the 3 steps."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    reference = _small_mlp(scope=False)
    reference.fit(x[:48], y[:48], batch_size=16, epochs=1, shuffle=False, verbose=0)
    model = _small_mlp(scope=False)
    try:
        hf.fit(
            model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
            strategy=strategy, callbacks=[held := _HeldInSteps(), _FailOnRank(1, 3)],
        )  # fmt: skip
        error = None
    except Exception as raised:  # noqa: BLE001 - the message is what the test checks
        error = str(raised)
    try:
        weights = relative_difference(model.get_weights(), reference.get_weights())
    except hf.NotHeldError as not_held:
        weights = str(not_held)
    return {"error": error, "weights": weights, "held_in_steps": held.held}


def fit_after_failure() -> dict:
    """After `failed_step`, in the same processes: a fresh model trains under ZeRO-3 to Keras's
    weights (before the loops got a communicator of their own, this fit hung: its first
    collective met a barrier the failed step left half-entered)."""
    x, y, reference = small_mlp_trained(seed=1)
    model = _small_mlp(scope=False)
    strategy = hf.Strategy("data", shard_weights=True)
    hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, strategy=strategy)
    return {"weights": relative_difference(model.get_weights(), reference.get_weights())}


if __name__ == "__main__":
    args()
    keras.config.disable_interactive_logging()
    failed = failed_step(hf.Strategy("data", shard_weights=True))
    tensor = failed_step(hf.Strategy("data", tensor=2))  # T=2 splits the two hidden Dense
    report(
        {
            "rank": hf.rank(),
            "failed_step": failed,
            "failed_tensor_step": tensor,
            "fit_after": fit_after_failure(),
        }
    )
