"""Every input `model.fit` takes, on 2 or 4 ranks, against Keras on the same ranks.

Arguments: the layouts to run each case in ("data", "model", "tensor" on 2 ranks; "hybrid",
P2 x R2, on 4). Each case is a factory of fresh `fit` arguments (a generator is used up by one
fit), trained once by Keras (by one rank, read by all: tests/support/references.py) and once by
`hf.fit` in each layout, from the same initial weights, with `shuffle=False`. Refusals are
compared with the error Keras raises for the same arguments, in the same process.
docs/keras_parity.md lists the cases.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from tests.support import custom_steps, references
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
    ),
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
    "tf_data",
    "tf_data_with_tf_data_validation",
    "py_dataset_sample_weight",
    "generator_steps_per_epoch",
    "arrays_steps_per_epoch_carry_over",
    "class_weight",
    "sample_weight_validation_split",
    "validation_freq_steps",
)


LAYOUTS = {
    "tensor": hf.Strategy("data", tensor=2),
    "hybrid": hf.Strategy("hybrid", partitions=2, replicas=2, microbatches=2),
}
EVERY_CASE = ("data", "model")  # the layouts that run every case and every refusal


def strategy_of(kind: str):
    return LAYOUTS.get(kind, kind)


def layouts_of(kinds, name: str) -> list[str]:
    """The layouts of `kinds` that run case `name`."""
    return [kind for kind in kinds if kind in EVERY_CASE or name in WAYS_IN]


def fit_request(name: str, arguments) -> references.Request:
    """Keras's fit of case `name` (tests/support/references.py: one rank trains it, all read)."""

    def train() -> dict:
        options = arguments()
        epochs = options.pop("epochs", 2)
        model = compiled("mlp", "adam")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras's "ran out of data" is expected in some cases
            history = model.fit(**options, epochs=epochs, shuffle=False, verbose=0)
        return {"weights": model.get_weights(), "history": history.history}

    return {"fit": "data_inputs", "case": name}, train


def run(kinds, name: str, arguments) -> list[dict]:
    """`hf.fit` in each layout of `kinds` that runs case `name`, against Keras's fit from the
    same initial weights."""
    layouts = layouts_of(kinds, name)
    reference = references.shared(*fit_request(name, arguments)) if layouts else None
    results = []
    for kind in layouts:
        again = arguments()  # fresh arguments: a generator is used up by one fit
        epochs = again.pop("epochs", 2)
        model = compiled("mlp", "adam")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as Keras's, above
            got = hf.fit(
                model, **again, epochs=epochs, shuffle=False, verbose=0, strategy=strategy_of(kind)
            )
        results.append(
            {
                "case": f"{kind}:{name}",
                "weights": relative_difference(model.get_weights(), reference["weights"]),
                "history": history_difference(got.history, reference["history"]),
                "epochs": [len(got.history["loss"]), len(reference["history"]["loss"])],
                "keys": [sorted(got.history), sorted(reference["history"])],
            }
        )
    return results


def refusal(kind: str, name: str, arguments) -> dict:
    messages = []
    for fit in (
        compiled("mlp", "adam").fit,
        lambda **o: hf.fit(compiled("mlp", "adam"), **o, strategy=kind),
    ):
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


def evaluate_request(name: str, arguments) -> references.Request:
    """Keras's `evaluate` and `predict` on case `name`'s inputs (shared as `fit_request`'s)."""

    def train() -> dict:
        reference = compiled("mlp", "adam")
        logs = reference.evaluate(**arguments(), verbose=0, return_dict=True)
        predicted = reference.predict(**_without_labels(arguments()), verbose=0)
        return {"logs": logs, "predicted": predicted}

    return {"evaluate": "data_inputs", "case": name}, train


def _without_labels(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in ("y", "sample_weight")}


def evaluated(kinds, name: str, arguments) -> list[dict]:
    """`evaluate` and `predict` of Keras and of hf on the same inputs (the same weights)."""
    reference = references.shared(*evaluate_request(name, arguments))
    ref_logs, ref_predicted = reference["logs"], reference["predicted"]
    results = []
    for kind in kinds:
        model, strategy = compiled("mlp", "adam"), strategy_of(kind)
        logs = hf.evaluate(model, **arguments(), verbose=0, return_dict=True, strategy=strategy)
        predicted = hf.predict(model, **_without_labels(arguments()), verbose=0, strategy=strategy)
        results.append(
            {
                "case": f"{kind}:evaluate_predict_{name}",
                "evaluate": history_difference(
                    {k: [v] for k, v in logs.items()}, {k: [v] for k, v in ref_logs.items()}
                ),
                "keys": [sorted(logs), sorted(ref_logs)],
                "predict": relative_difference([predicted], [ref_predicted]),
                "shapes": [list(predicted.shape), list(ref_predicted.shape)],
            }
        )
    return results


# A 2-output model (a dict of losses, loss_weights) on 44 samples in batches of 16: the last
# batch has 12. Keras's compiled fit counts each batch once in its per-output loss means
# ("regression_loss", ...); eager Keras's weighting is tests/test_output_losses.py's.
PER_OUTPUT_LOSS_WEIGHTS = {"regression": 0.5, "classes": 2.0}  # compiled("multi_io", ...)'s


def per_output_request() -> references.Request:
    """Keras's fit (validation included) and evaluate of the 2-output model."""

    def train() -> dict:
        (x, y), validation = data("multi_io", n=44), data("multi_io", n=20, seed=1)
        reference = compiled("multi_io", "adam")
        history = reference.fit(x, y, **_PER_OUTPUT_FIT, validation_data=validation)
        logs = reference.evaluate(*validation, batch_size=8, verbose=0, return_dict=True)
        return {"weights": reference.get_weights(), "history": history.history, "logs": logs}

    return {"fit": "data_inputs", "case": "per_output_losses"}, train


_PER_OUTPUT_FIT = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)


def per_output(kinds) -> list[dict]:
    """History (with validation) and evaluate of Keras and `hf.fit` for a 2-output model."""
    (x, y), validation = data("multi_io", n=44), data("multi_io", n=20, seed=1)
    reference = references.shared(*per_output_request())
    ref_history, ref_evaluated = reference["history"], reference["logs"]
    results = []
    for kind in kinds:
        model = compiled("multi_io", "adam")
        strategy = strategy_of(kind)
        got = hf.fit(model, x, y, **_PER_OUTPUT_FIT, validation_data=validation, strategy=strategy)
        evaluated = hf.evaluate(
            model, *validation, batch_size=8, strategy=strategy, return_dict=True
        )
        results.append(
            {
                "case": f"{kind}:per_output_losses",
                "weights": relative_difference(model.get_weights(), reference["weights"]),
                "history": history_difference(got.history, ref_history),
                "evaluate": history_difference(
                    {k: [v] for k, v in evaluated.items()},
                    {k: [v] for k, v in ref_evaluated.items()},
                ),
                "epochs": [len(got.history["loss"]), len(ref_history["loss"])],
                "keys": [sorted(got.history), sorted(ref_history)],
                "reference": ref_history,
            }
        )
    return results


def requests(kinds) -> list[references.Request]:
    """The Keras references the layouts of `kinds` compare with, for `references.prefetch`."""
    fits = [fit_request(name, case) for name, case in CASES.items() if layouts_of(kinds, name)]
    evaluations = [evaluate_request(name, case) for name, case in EVALUATED.items()]
    return fits + [per_output_request()] + evaluations


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    kinds = args()
    references.prefetch(requests(kinds))  # each reference trained by one rank
    results = [result for name, case in CASES.items() for result in run(kinds, name, case)]
    results += custom_steps.results() if "data" in kinds else []  # own train_step, compute_loss
    results += custom_steps.sharded_results()  # and under ZeRO-1/2/3, every rank a replica
    results += custom_steps.resume_results() if "data" in kinds else []  # from a checkpoint
    results += per_output([kind for kind in kinds if kind != "tensor"])
    results += [r for name, case in EVALUATED.items() for r in evaluated(kinds, name, case)]
    every = [kind for kind in kinds if kind in EVERY_CASE]
    refusals = [refusal(kind, name, case) for kind in every for name, case in REFUSED.items()]
    report({"rank": hf.rank(), "results": results, "refusals": refusals})
