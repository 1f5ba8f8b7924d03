"""hf.fit from an HDF5 file on 2 ranks: equal to Keras on the same arrays, and memory-bounded.

Arguments: "equivalence FILE KIND..." (FILE written by tests/test_hdf5.py from
`tests.support.models.data`) or "memory FILE STEPS KIND..." (FILE holds "x" (n, FEATURES) float32
and "y" labels; each rank reports the growth of its peak RSS while training).
"""

import time

import keras

import hyparflow as hf
import hyparflow.data
from tests.support import references
from tests.support.compare import history_difference, relative_difference
from tests.support.models import compiled, data, sample_weights
from tests.support.report import args, report

BATCH, EPOCHS = 16, 2


def equivalence_cases(path: str):
    """name -> (model name, HDF5 reader, the same data as in-memory fit arguments)."""
    x, y = data("mlp")
    mx, my = data("multi_io")
    w = sample_weights(len(x))
    reader = hyparflow.data.HDF5
    return {
        "mlp": ("mlp", reader(path, x="mlp/x", y="mlp/y"), dict(x=x, y=y)),
        "sample_weight": (
            "mlp",
            reader(path, x="mlp/x", y="mlp/y", sample_weight="mlp/w"),
            dict(x=x, y=y, sample_weight=w),
        ),
        "multi_io": (
            "multi_io",
            reader(
                path,
                x={"a": "multi/a", "b": "multi/b"},
                y={"regression": "multi/regression", "classes": "multi/classes"},
            ),
            dict(x=mx, y=my),
        ),
        "list_inputs": (
            "multi_io",
            reader(
                path,
                x=["multi/a", "multi/b"],
                y={"regression": "multi/regression", "classes": "multi/classes"},
            ),
            dict(x=[mx["a"], mx["b"]], y=my),
        ),
    }


def reference_request(name: str, model_name: str, arrays: dict) -> references.Request:
    """Keras's fit and evaluate on the arrays of case `name` (one rank trains it, all read:
    tests/support/references.py)."""

    def train() -> dict:
        reference = compiled(model_name, "adam")
        ref = reference.fit(**arrays, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        logs = reference.evaluate(**arrays, batch_size=8, verbose=0, return_dict=True)
        return {"weights": reference.get_weights(), "history": ref.history, "logs": logs}

    return {"fit": "hdf5_inputs", "case": name}, train


def equivalence(kind: str, name: str, model_name: str, reader, arrays: dict) -> dict:
    reference = references.shared(*reference_request(name, model_name, arrays))
    model = compiled(model_name, "adam")
    got = hf.fit(
        model, reader, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, strategy=kind
    )
    evaluated = hf.evaluate(model, reader, batch_size=8, strategy=kind, return_dict=True)
    return {
        "case": f"{kind}-{name}",
        "weights": relative_difference(model.get_weights(), reference["weights"]),
        "history": history_difference(got.history, reference["history"]),
        "evaluate": history_difference(
            {k: [v] for k, v in evaluated.items()}, {k: [v] for k, v in reference["logs"].items()}
        ),
    }


def shuffled(kind: str, path: str) -> dict:
    """Shuffled HDF5 batches are the shuffled in-memory batches: the same order, every sample."""
    x, y = data("mlp")
    from_arrays = compiled("mlp", "adam")  # seeds Keras: both fits draw the same shuffle seed
    hf.fit(
        from_arrays, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, strategy=kind
    )
    model = compiled("mlp", "adam")
    reader = hyparflow.data.HDF5(path, x="mlp/x", y="mlp/y")
    hf.fit(model, reader, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, strategy=kind)
    unshuffled = compiled("mlp", "adam")
    hf.fit(
        unshuffled, reader, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, strategy=kind
    )
    return {
        "case": f"{kind}-shuffled",
        "weights": relative_difference(model.get_weights(), from_arrays.get_weights()),
        "differs_from_unshuffled": relative_difference(
            model.get_weights(), unshuffled.get_weights()
        ),
    }


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory(path: str, kind: str, steps: int) -> dict:
    """Peak RSS growth while training 2 shuffled epochs of `steps` steps from a large file."""
    reader = hyparflow.data.HDF5(path, x="x", y="y")
    features = reader.datasets[0].shape[1]
    keras.utils.set_random_seed(7)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    history = hf.fit(
        model,
        reader,
        batch_size=64,
        epochs=2,
        steps_per_epoch=steps,
        shuffle=True,
        verbose=0,
        strategy=kind,
    )
    return {
        "case": f"{kind}-memory",
        "seconds": time.perf_counter() - start,
        "rss_before_mib": before / 1024,
        "peak_growth_mib": (status_kib("VmHWM") - before) / 1024,
        "loss": history.history["loss"],
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    mode, path, *rest = args()
    if mode == "equivalence":
        cases = equivalence_cases(path)
        references.prefetch(
            [reference_request(name, model, arrays) for name, (model, _, arrays) in cases.items()]
        )
        results = []
        for kind in rest:
            for name, case in equivalence_cases(path).items():
                results.append(equivalence(kind, name, *case))
            results.append(shuffled(kind, path))
    else:
        steps, *kinds = rest
        results = [memory(path, kind, int(steps)) for kind in kinds]
    report({"rank": hf.rank(), "results": results})
