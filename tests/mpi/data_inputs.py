"""Every input `model.fit` takes, on 2 or 4 ranks, against Keras in the same process.

Arguments: the layouts to run each case in ("data", "model", "tensor" on 2 ranks; "hybrid",
P2 x R2, on 4). Each case is a factory
of fresh `fit` arguments (a generator is used up by one fit), trained once by Keras and once by
`hf.fit` from the same initial weights, with `shuffle=False`. Refusals are compared with the
error Keras raises for the same arguments. docs/keras_parity.md lists the cases.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from tests.support import custom_steps
from tests.support.compare import history_difference, relative_difference
from tests.support.models import compiled, data
from tests.support.report import args, report

BATCH = 16
X, Y = data("mlp")  # 70 samples: 4 batches of 16 and one of 6
W = np.random.default_rng(5).uniform(0.5, 2.0, len(X)).astype("float32")
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0}


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, w=None, **options):
        super().__init__(**options)
        self.x, self.y, self.w = x, y, w

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        cut = slice(i * BATCH, (i + 1) * BATCH)
        batch = (self.x[cut], self.y[cut])
        return batch if self.w is None else (*batch, self.w[cut])


def batches(x, y, repeat=1):
    """A generator of (x, y) batches, `repeat` passes over the data."""
    for _ in range(repeat):
        for start in range(0, len(x), BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


def dataset(x, y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


CASES = {
    "tf_data": lambda: dict(x=dataset(X, Y)),
    "tf_data_class_weight": lambda: dict(x=dataset(X, Y), class_weight=CLASS_WEIGHT),
    "tf_data_with_tf_data_validation": lambda: dict(
        x=dataset(X, Y), validation_data=dataset(X[:24], Y[:24])
    ),
    "py_dataset_sample_weight": lambda: dict(x=Batches(X, Y, W)),
    "py_dataset_threads_class_weight": lambda: dict(
        x=Batches(X, Y, workers=2), class_weight=CLASS_WEIGHT
    ),
    "arrays_with_py_dataset_validation": lambda: dict(
        x=X, y=Y, batch_size=BATCH, validation_data=Batches(X[:40], Y[:40])
    ),
    "arrays_with_list_validation": lambda: dict(
        x=X, y=Y, batch_size=BATCH, validation_data=[X[:20], Y[:20]], validation_batch_size=8
    ),
    "generator": lambda: dict(x=batches(X, Y), epochs=1),
    "generator_steps_per_epoch": lambda: dict(x=batches(X, Y, repeat=2), steps_per_epoch=3),
    "arrays_steps_per_epoch_carry_over": lambda: dict(
        x=X, y=Y, batch_size=BATCH, steps_per_epoch=3, epochs=3
    ),
    "arrays_steps_per_epoch_without_batch_size": lambda: dict(
        x=X[:64], y=Y[:64], steps_per_epoch=4, epochs=2
    ),
    "sample_weight_validation_split": lambda: dict(
        x=X, y=Y, batch_size=BATCH, sample_weight=W, validation_split=0.25
    ),
    "class_weight": lambda: dict(x=X, y=Y, batch_size=BATCH, class_weight=CLASS_WEIGHT),
    "validation_freq_steps": lambda: dict(
        x=X,
        y=Y,
        batch_size=BATCH,
        validation_data=(X[:20], Y[:20]),
        validation_freq=2,
        validation_steps=1,
        epochs=3,
    ),  # fmt: skip
    "initial_epoch": lambda: dict(x=X, y=Y, batch_size=BATCH, initial_epoch=1, epochs=3),
}

REFUSED = {  # what Keras refuses, hyparflow must refuse with Keras's message
    "sample_weight_and_class_weight": lambda: dict(
        x=X, y=Y, batch_size=BATCH, sample_weight=W, class_weight=CLASS_WEIGHT
    ),
    "tf_data_with_y": lambda: dict(x=dataset(X, Y), y=Y),
    "generator_class_weight": lambda: dict(x=batches(X, Y), class_weight=CLASS_WEIGHT),
    "tf_data_validation_split": lambda: dict(x=dataset(X, Y), validation_split=0.2),
}


# The tensor (T=2) and hybrid (P2 x R2) layouts read data as the data and model layouts do:
# they run the cases that exercise each way in (docs/keras_parity.md), not every argument again.
WAYS_IN = (
    "tf_data", "tf_data_with_tf_data_validation", "py_dataset_sample_weight",
    "generator_steps_per_epoch", "arrays_steps_per_epoch_carry_over", "class_weight",
    "sample_weight_validation_split", "validation_freq_steps",
)  # fmt: skip


LAYOUTS = {
    "tensor": hf.Strategy("data", tensor=2),
    "hybrid": hf.Strategy("hybrid", partitions=2, replicas=2, microbatches=2),
}
EVERY_CASE = ("data", "model")  # the layouts that run every case and every refusal


def strategy_of(kind: str):
    return LAYOUTS.get(kind, kind)


def run(kinds, name: str, arguments) -> list[dict]:
    """Keras once, then `hf.fit` in each layout of `kinds`, from the same initial weights."""
    options = arguments()
    epochs = options.pop("epochs", 2)
    reference = compiled("mlp", "adam")
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "ran out of data" is expected in some cases
        ref = reference.fit(**options, epochs=epochs, shuffle=False, verbose=0)
        for kind in kinds:
            if kind not in EVERY_CASE and name not in WAYS_IN:
                continue
            again = arguments()  # fresh arguments: a generator is used up by one fit
            again.pop("epochs", None)
            model = compiled("mlp", "adam")
            got = hf.fit(model, **again, epochs=epochs, shuffle=False, verbose=0,
                         strategy=strategy_of(kind))  # fmt: skip
            results.append({
                "case": f"{kind}:{name}",
                "weights": relative_difference(model.get_weights(), reference.get_weights()),
                "history": history_difference(got.history, ref.history),
                "epochs": [len(got.history["loss"]), len(ref.history["loss"])],
                "keys": [sorted(got.history), sorted(ref.history)],
            })  # fmt: skip
    return results


def refusal(kind: str, name: str, arguments) -> dict:
    messages = []
    for fit in (compiled("mlp", "adam").fit, lambda **o: hf.fit(compiled("mlp", "adam"), **o,
                                                                strategy=kind)):  # fmt: skip
        try:
            fit(**arguments(), epochs=1, verbose=0)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return {"case": f"{kind}:{name}", "keras": messages[0], "hyparflow": messages[1]}


EVALUATED = {  # evaluate's inputs (predict takes their x)
    "tf_data": lambda: dict(x=dataset(X, Y)),
    "py_dataset_sample_weight": lambda: dict(x=Batches(X, Y, W)),
    "generator": lambda: dict(x=batches(X, Y)),
    "arrays_sample_weight": lambda: dict(x=X, y=Y, sample_weight=W, batch_size=BATCH),
}


def evaluated(kinds, name: str, arguments) -> list[dict]:
    """`evaluate` and `predict` of Keras and of hf on the same inputs (the same weights)."""
    reference = compiled("mlp", "adam")
    ref_logs = reference.evaluate(**arguments(), verbose=0, return_dict=True)
    without_labels = {k: v for k, v in arguments().items() if k not in ("y", "sample_weight")}
    ref_predicted = reference.predict(**without_labels, verbose=0)
    results = []
    for kind in kinds:
        model, strategy = compiled("mlp", "adam"), strategy_of(kind)
        logs = hf.evaluate(model, **arguments(), verbose=0, return_dict=True, strategy=strategy)
        without_labels = {k: v for k, v in arguments().items() if k not in ("y", "sample_weight")}
        predicted = hf.predict(model, **without_labels, verbose=0, strategy=strategy)
        results.append({
            "case": f"{kind}:evaluate_predict_{name}",
            "evaluate": history_difference({k: [v] for k, v in logs.items()},
                                           {k: [v] for k, v in ref_logs.items()}),
            "keys": [sorted(logs), sorted(ref_logs)],
            "predict": relative_difference([predicted], [ref_predicted]),
            "shapes": [list(predicted.shape), list(ref_predicted.shape)],
        })  # fmt: skip
    return results


# A 2-output model (a dict of losses, loss_weights) on 44 samples in batches of 16: the last
# batch has 12. Keras's compiled fit counts each batch once in its per-output loss means
# ("regression_loss", ...); eager Keras's weighting is tests/test_output_losses.py's.
PER_OUTPUT_LOSS_WEIGHTS = {"regression": 0.5, "classes": 2.0}  # compiled("multi_io", ...)'s


def per_output(kinds) -> list[dict]:
    """History (with validation) and evaluate of Keras and `hf.fit` for a 2-output model."""
    (x, y), validation = data("multi_io", n=44), data("multi_io", n=20, seed=1)
    fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=validation)
    reference = compiled("multi_io", "adam")
    ref = reference.fit(x, y, **fit)
    ref_evaluated = reference.evaluate(*validation, batch_size=8, verbose=0, return_dict=True)
    results = []
    for kind in kinds:
        model = compiled("multi_io", "adam")
        strategy = strategy_of(kind)
        got = hf.fit(model, x, y, **fit, strategy=strategy)
        evaluated = hf.evaluate(
            model, *validation, batch_size=8, strategy=strategy, return_dict=True
        )
        results.append({
            "case": f"{kind}:per_output_losses",
            "weights": relative_difference(model.get_weights(), reference.get_weights()),
            "history": history_difference(got.history, ref.history),
            "evaluate": history_difference(
                {k: [v] for k, v in evaluated.items()}, {k: [v] for k, v in ref_evaluated.items()}
            ),
            "epochs": [len(got.history["loss"]), len(ref.history["loss"])],
            "keys": [sorted(got.history), sorted(ref.history)],
            "reference": ref.history,
        })  # fmt: skip
    return results


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    kinds = args()
    results = [result for name, case in CASES.items() for result in run(kinds, name, case)]
    results += custom_steps.results() if "data" in kinds else []  # own train_step, compute_loss
    results += per_output([kind for kind in kinds if kind != "tensor"])
    results += [r for name, case in EVALUATED.items() for r in evaluated(kinds, name, case)]
    every = [kind for kind in kinds if kind in EVERY_CASE]
    refusals = [refusal(kind, name, case) for kind in every for name, case in REFUSED.items()]
    report({"rank": hf.rank(), "results": results, "refusals": refusals})
