"""Every kind of input hf.fit takes, on 2 ranks, against single-process Keras.

Arguments: strategy kinds to run each case with ("data", "model").
"""

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from tests.support.compare import history_difference, relative_difference
from tests.support.models import compiled, data
from tests.support.report import args, report

BATCH = 16


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, w):
        super().__init__()
        self.x, self.y, self.w = x, y, w

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        cut = slice(i * BATCH, (i + 1) * BATCH)
        return self.x[cut], self.y[cut], self.w[cut]


def cases():
    x, y = data("mlp")
    w = np.random.default_rng(5).uniform(0.5, 2.0, len(x)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return {
        "tf_data": (dict(x=dataset), {}),
        "py_dataset": (dict(x=Batches(x, y, w)), {}),
        "sample_weight_validation_split": (
            dict(x=x, y=y, batch_size=BATCH, sample_weight=w, validation_split=0.25),
            {},
        ),
        "class_weight": (dict(x=x, y=y, batch_size=BATCH, class_weight={0: 0.5, 1: 2.0}), {}),
        "validation_freq_steps": (
            dict(x=x, y=y, batch_size=BATCH, validation_data=(x[:20], y[:20])),
            dict(validation_freq=2, epochs=3),
        ),
    }


def run(kind: str, name: str, inputs: dict, extra: dict) -> dict:
    epochs = extra.pop("epochs", 2)
    reference = compiled("mlp", "adam")
    ref = reference.fit(**inputs, epochs=epochs, shuffle=False, verbose=0, **extra)
    model = compiled("mlp", "adam")
    got = hf.fit(model, **inputs, epochs=epochs, shuffle=False, verbose=0, strategy=kind, **extra)
    trainer = model._hyparflow_trainer[1]
    traces = trainer.runner._forward_fn.experimental_get_tracing_count() + (
        trainer.runner._loss_forward_fn.experimental_get_tracing_count()
    )
    return {
        "case": f"{kind}:{name}",
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "history": history_difference(got.history, ref.history),
        "keys": sorted(got.history),
        "ref_keys": sorted(ref.history),
        "traces": traces,
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    results = [run(kind, name, *case) for kind in args() for name, case in cases().items()]
    report({"rank": hf.rank(), "results": results})
