"""Memory scenarios: a rank's measured peak growth next to the memory plan's prediction, and
training under a per-rank memory cap (tests/test_memory_plan.py, tests/test_memory_caps.py).

Arguments: the scenario ("measure"), then a layout spec "P,R,T[,flags]" (`layout`) and the
MLP's "WIDTH,DEPTH" (see `wide_mlp`). Every rank reports its measured growth, its plan line,
when it trained the final loss, and with ZeRO-1 the bytes it sends per step (`zero_bytes`:
reduce-scatter and all-gather) next to what an allreduce of the same gradients would send.
"""

import contextlib
import sys

import keras
import numpy as np

import hyparflow as hf
from hyparflow.auto.choose import last_choice
from hyparflow.memory.resident import PeakGrowth, resident_bytes
from tests.support.report import args, report, run_or_abort

INPUTS, CLASSES, SAMPLES, BATCH = 256, 10, 128, 32


def wide_mlp(
    width: int, depth: int, optimizer: str = "adam", scope: bool = False, subclassed=False
):
    """A weight-heavy MLP: `depth` Dense(width) layers (width² parameters each) on 256
    inputs, so weights and optimizer state dominate and activations are small; built under
    `hf.scope()` (no weight allocated until hf.fit) with `scope`; the same layers in a
    subclassed model (no layer graph) with `subclassed`."""
    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.get(optimizer)  # before the scope (docs/big_models.md)
    with hf.scope() if scope else contextlib.nullcontext():
        if subclassed:
            model = WideMLP(width, depth)
            model(keras.Input((INPUTS,)))
        else:
            x = keras.Input((INPUTS,))
            h = x
            for _ in range(depth):
                h = keras.layers.Dense(width, activation="relu")(h)
            model = keras.Model(x, keras.layers.Dense(CLASSES)(h), name=f"mlp{width}x{depth}")
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class WideMLP(keras.Model):
    """`wide_mlp`'s layers as a subclassed model."""

    def __init__(self, width: int, depth: int):
        super().__init__(name=f"subclassed_mlp{width}x{depth}")
        self.hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        self.head = keras.layers.Dense(CLASSES)

    def call(self, x):
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(SAMPLES, INPUTS)).astype("float32"), rng.integers(0, CLASSES, SAMPLES)


def layout(spec: str) -> hf.Strategy:
    """ "P,R,T[,flags]" as the Strategy hf.fit trains with; flags: "zero" (the optimizer's
    state sharded over the replicas, ZeRO-1), "zero2" (its gradients too), "zero3" (its
    weights too), "subclassed" (the model, see `measure`), "params" (stages
    balanced by parameters), "scope" (built under hf.scope(), see `measure`), "segment"
    (`update_by_segment=True`; "whole": False), "interleaved" (two model chunks a stage, 4
    micro-batches). "auto[,scope]": the planner picks the layout (hf.fit's default)."""
    if spec.split(",")[0] == "auto":  # the planner's pick (hf.fit's default)
        return hf.Strategy()
    p, r, t, *flags = spec.split(",")
    kind = "data" if int(p) == 1 else ("model" if int(r) == 1 else "hybrid")
    balance = "params" if "params" in flags else "layers"
    by_segment = True if "segment" in flags else (False if "whole" in flags else None)
    chunked = dict(schedule="interleaved", microbatches=4) if "interleaved" in flags else {}
    return hf.Strategy(
        kind,
        partitions=int(p),
        replicas=int(r),
        tensor=int(t),
        balance=balance,
        shard_optimizer="zero" in flags,
        shard_gradients="zero2" in flags,
        shard_weights="zero3" in flags,
        update_by_segment=by_segment,
        **chunked,
    )


def measure(spec: str, shape: str, optimizer: str = "adam") -> dict:
    """Train one epoch and return this rank's peak growth (from before the model is built to
    the epoch's end) beside its line of the memory plan, and the loss."""
    width, depth = (int(v) for v in shape.split(","))
    strategy = layout(spec)
    x, y = data()
    hf.size()  # MPI and TensorFlow's imports are done before measuring
    base = resident_bytes()
    with PeakGrowth() as growth:
        flags = spec.split(",")
        model = wide_mlp(width, depth, optimizer, "scope" in flags, "subclassed" in flags)
        history = hf.fit(
            model, x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, strategy=strategy
        )
    if strategy.leaves_layout_open() and hf.size() > 1:
        strategy = last_choice(model, hf.size()).strategy  # what the planner picked
    plan = hf.memory_plan(model, strategy, batch_size=BATCH)
    line = plan.ranks[hf.rank()]
    trainer = getattr(model, "_hyparflow_trainer", (None, None))[1]  # none in one process
    zero = None if trainer is None else trainer.parts.sharded_update
    sent = (
        {}
        if zero is None
        else {"zero_bytes": dict(zero.step_bytes), "allreduce_bytes": zero.allreduce_bytes}
    )
    return {
        "spec": spec,
        "layout": [strategy.partitions, strategy.replicas, strategy.tensor],
        "sharding": strategy.sharding,
        "growth": growth.bytes,
        "exact_peak": growth.exact,
        "base": base,
        "predicted": line.total,
        "line": line.to_dict(),
        "loss": float(history.history["loss"][-1]),
        **sent,  # with ZeRO-1: one step's bytes sent by this rank, and an allreduce's
    }


def main():
    scenario, *rest = args()
    result = {"measure": measure}[scenario](*rest)
    report(result)


if __name__ == "__main__":
    run_or_abort(main)
    sys.exit(0)
