"""Train models whose odd-sized layers tensor=2 keeps whole (tests/support/whole_models.py)
with hf.fit and with Keras's own fit; report how far apart they end.

Arguments: cases as JSON (tests/support/cases.py). The Keras reference is trained once and read
by every rank (tests/support/references.py).
"""

import keras
import numpy as np

import hyparflow as hf
from tests.support import references, whole_models
from tests.support.cases import Case
from tests.support.compare import history_difference, relative_difference
from tests.support.fits import fit_in_order
from tests.support.report import args, report, run_or_abort

BATCH, EPOCHS = 16, 2


def keras_request(case: Case):
    def train() -> dict:
        x, y = whole_models.data(case.model)
        model = whole_models.compiled(case.model, case.optimizer)
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        paths = [v.path for v in model.weights]
        return {"weights": model.get_weights(), "paths": paths, "history": history.history}

    return {"fit": "tensor_whole", "model": case.model, "optimizer": case.optimizer}, train


def run(case: Case) -> dict:
    reference = references.shared(*keras_request(case))
    x, y = whole_models.data(case.model)
    model = whole_models.compiled(case.model, case.optimizer)
    history = fit_in_order(model, x, y, BATCH, EPOCHS, hf.Strategy(**case.strategy_options()))
    layout = model._hyparflow_trainer[1].sharded_layers.tensor.layout
    weights = model.get_weights()
    return {
        "case": case.id,
        "weights": relative_difference(weights, reference["weights"]),
        "worst": _worst(weights, reference),
        "history": history_difference(history.history, reference["history"]),
        "split": [s.layer.name for s in layout.splits],
        "whole": list(layout.replicated),
    }


def _worst(weights, reference) -> str:
    """The path of the weight farthest from Keras's, for the failure message."""
    gaps = [
        relative_difference([w], [r]) for w, r in zip(weights, reference["weights"], strict=True)
    ]
    return reference["paths"][int(np.argmax(gaps))]


def main() -> None:
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in args()]
    references.prefetch([keras_request(c) for c in cases])
    report({"rank": hf.rank(), "results": [run(c) for c in cases]})


if __name__ == "__main__":
    run_or_abort(main)
