"""`strategy="auto"` under a real mpirun: the planner's pick, agreed by every rank, trains
exactly as Keras does; a budget moves it off data parallelism, for a model built under
hf.scope() too; what cannot be timed stays data
parallel; a budget nothing fits is refused on every rank.

Usage: `python -m tests.mpi.auto_fit OUT`.
"""

import keras
import numpy as np

import hyparflow as hf
from hyparflow import deferred
from hyparflow.auto.choose import last_choice
from tests.support.compare import history_difference, relative_difference
from tests.support.fits import fit_in_order
from tests.support.report import report, run_or_abort

BATCH, EPOCHS, WIDTH = 32, 2, 256


def weight_heavy(seed: int = 3):
    """An MLP whose weights dominate its bytes, so a pipeline holds less per rank than a
    replica of the whole."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32,))
    x = inputs
    for k in range(4):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{k}")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.MeanSquaredError())
    return model


def activation_heavy():
    """Few weights, wide activations: micro-batches and recomputation hold less than a
    replica's whole share."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((32,))
    x = keras.layers.Dense(2048, name="wide")(inputs)
    for k in range(8):
        x = keras.layers.Activation("tanh", name=f"tanh_{k}")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(x))
    # SGD: Adam divides near-zero gradients of saturated units by their own size, so the
    # summation order of micro-batches shows at 1e-5 (the weight-heavy model trains Adam)
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.MeanSquaredError())
    return model


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16 * BATCH, 32)).astype("float32"), rng.normal(
        size=(16 * BATCH, 4)
    ).astype("float32")


def keras_reference(x, y) -> dict:
    model = weight_heavy()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {"weights": model.get_weights(), "history": history.history}


def picked(model) -> dict:
    choice = last_choice(model, hf.size())
    return {
        "strategy": repr(choice.strategy),
        "label": choice.result.pick.candidate.label(),
        "bytes": choice.result.pick.estimate.bytes_per_rank,
    }


def open_auto(x, y) -> dict:
    """The default strategy: the planner picks; a second fit reuses the pick; evaluate runs
    on the layout trained."""
    reference = keras_reference(x, y)
    model = weight_heavy()
    history = hf.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=2)
    first = last_choice(model, hf.size())
    trainer = model._hyparflow_trainer[1]
    hf.evaluate(model, x, y, batch_size=BATCH, verbose=0)
    weights = relative_difference(model.get_weights(), reference["weights"])
    hf.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # same arguments
    again = last_choice(model, hf.size())
    return {
        **picked(model),
        "weights": weights,
        "history": history_difference(history.history, reference["history"]),
        "evaluate_same_trainer": model._hyparflow_trainer[1] is trainer,
        "planned_once": again is first and len(model._hyparflow_auto_plans) == 1,
        "seconds": first.seconds,
    }


def under_budget(x, y) -> dict:
    """A budget below data parallelism's bytes without micro-batches (and above a 1F1B
    pipeline's with 8 and recomputation): the pick fits it and trains exactly."""
    batch, world = 8 * BATCH, hf.size()
    plain = hf.memory_plan(activation_heavy(), hf.Strategy("data", replicas=world), batch)
    piped = hf.memory_plan(
        activation_heavy(),
        hf.Strategy("model", partitions=world, microbatches=8, schedule="1f1b", recompute=True),
        batch,
    )
    budget = (plain.largest.total + piped.largest.total) // 2
    reference = activation_heavy()
    reference.fit(x, y, batch_size=batch, epochs=EPOCHS, shuffle=False, verbose=0)
    model = activation_heavy()
    fit_in_order(model, x, y, batch, EPOCHS, hf.Strategy(memory_per_rank=budget))
    weights = relative_difference(model.get_weights(), reference.get_weights())
    refused = nothing_fits(model, x, y, batch)
    timed_once = len(model._hyparflow_auto_costs) == 1
    return {
        **picked(model),
        "budget": budget,
        "data_bytes": plain.largest.total,
        "weights": weights,
        "refused": refused,
        "timed_once": timed_once,
    }


def nothing_fits(model, x, y, batch) -> str:
    """A budget no layout fits, on a model already timed at this batch (not timed again)."""
    try:
        hf.fit(
            model, x, y, batch_size=batch, verbose=0, strategy=hf.Strategy(memory_per_rank="1MiB")
        )
    except (ValueError, RuntimeError) as error:  # RemoteRankError on the ranks that did not search
        return f"{type(error).__name__}: {error}"
    return "trained"


def deferred_under_budget(x, y) -> dict:
    """The weight-heavy MLP built under hf.scope(), with a budget below data parallelism's
    bytes (and above a pipeline's over the ranks): the planner times it layer by layer (it
    holds no weights to run), and the pick trains what Keras trains, on the weights each rank
    holds."""
    world = hf.size()
    with hf.scope():
        model = weight_heavy()
    plain = hf.memory_plan(model, hf.Strategy("data", replicas=world), BATCH).largest.total
    piped = hf.memory_plan(model, hf.Strategy("model", partitions=world), BATCH).largest.total
    budget = (plain + piped) // 2
    reference = keras_reference(x, y)
    history = hf.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=2,
        strategy=hf.Strategy(memory_per_rank=budget),
    )
    held = [i for i, v in enumerate(model.weights) if not deferred.is_deferred(v)]
    mine = [model.weights[i].numpy() for i in held]
    return {
        **picked(model),
        "budget": budget,
        "data_bytes": plain,
        "held": len(held),
        "weights": relative_difference(mine, [reference["weights"][i] for i in held]),
        "history": history_difference(history.history, reference["history"]),
    }


def subclassed(x, y) -> str:
    model = Subclassed()
    model.compile("sgd", "mse")
    hf.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0)
    return repr(model._hyparflow_trainer[0][0])


def unknown_batch(x, y) -> str:
    """A Dataset whose batch has no static size: the planner cannot know the batch."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model = weight_heavy()
    hf.fit(model, dataset, epochs=1, verbose=0)
    return repr(model._hyparflow_trainer[0][0])


def untimeable(x, y) -> str:
    """Variable-length token ids given as a dict: no shape to time the layers at."""
    keras.utils.set_random_seed(5)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(4)(hidden))
    model.compile("sgd", "mse")
    ids = np.random.default_rng(1).integers(0, 50, size=(len(y), 7)).astype("int32")
    hf.fit(model, {"tokens": ids}, y, batch_size=BATCH, epochs=1, verbose=2)
    return repr(model._hyparflow_trainer[0][0])


def main():
    x, y = data()
    report(
        {
            "open": open_auto(x, y),
            "budget": under_budget(x, y),
            "deferred": deferred_under_budget(x, y),
            "subclassed": subclassed(x, y),
            "unknown_batch": unknown_batch(x, y),
            "untimeable": untimeable(x, y),
        }
    )


if __name__ == "__main__":
    run_or_abort(main)
