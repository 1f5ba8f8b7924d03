"""Train each keras_hub family of the zoo (tests/support/hub_zoo.py) with hf.fit and with Keras.

Arguments: cases as JSON (tests/support/cases.py), `model` a family name. The Keras reference
(one process's `model.fit` from the same seeded weights) is trained once per session and read
by every rank (tests/support/references.py).

A family may be refused or may fail: each case's error is reported as its result rather than
ending the job, so the zoo's table can say why. The ranks then meet in a barrier of their own;
a rank whose peer does not arrive within `AGREE_SECONDS` (left blocked inside a failed step)
aborts the job, and the test relaunches the cases after it. Each rank rewrites its report
after every case, so an aborted job still tells which cases ended and how.
"""

import time

import keras
import numpy as np
from mpi4py import MPI

import hyparflow as hf
from tests.support import hub_zoo, references
from tests.support.cases import Case
from tests.support.compare import history_difference, relative_difference
from tests.support.report import args, report
from tests.support.tolerances import tolerance

AGREE_SECONDS = 120  # a refusal raises on every rank at once; a peer this late is stuck
POLL_SECONDS = 0.05


def request(family: str):
    """The family's Keras reference, for `references`: its weights and History, and its float
    floors, how far Keras alone ends from them with every initial weight moved by 1e-7
    relative (about one float32 unit; docs/testing.md), the whole model's and each weight's:
    what no tolerance can go under."""

    def train() -> dict:
        weights, history = _keras_fit(family)
        nudged, _ = _keras_fit(family, nudge=1e-7)
        floors = [relative_difference([n], [w]) for n, w in zip(nudged, weights, strict=True)]
        return {"weights": weights, "history": history, "floor": max(floors), "floors": floors}

    key = {
        "fit": "hub_zoo_floors_epsilon",
        "family": family,
        "samples": hub_zoo.SAMPLES,
        "batch": hub_zoo.BATCH,
        "epochs": hub_zoo.EPOCHS,
    }
    return key, train


def _keras_fit(family: str, nudge: float = 0.0):
    model = hub_zoo.compiled(family)
    x, y = hub_zoo.data(family, model)
    if nudge:
        model.set_weights([w * np.asarray(1 + nudge, w.dtype) for w in model.get_weights()])
    history = model.fit(
        x, y, batch_size=hub_zoo.BATCH, epochs=hub_zoo.EPOCHS, shuffle=False, verbose=0
    )
    return model.get_weights(), history.history


def run(case: Case) -> dict:
    """hf.fit of the case's family against the reference: the worst weight and History
    differences, or the error hf.fit raised."""
    started = time.monotonic()
    try:
        measured = _trained(case)
    except Exception as error:  # a refusal or a crash: the table records it
        measured = {"error": f"{type(error).__name__}: {error}"[:600]}
    return {"case": case.id, "seconds": round(time.monotonic() - started, 1), **measured}


def _trained(case: Case) -> dict:
    reference = references.shared(*request(case.model))
    model = hub_zoo.compiled(case.model)
    x, y = hub_zoo.data(case.model, model)
    history = hf.fit(
        model,
        x,
        y,
        batch_size=hub_zoo.BATCH,
        epochs=hub_zoo.EPOCHS,
        shuffle=False,
        verbose=0,
        strategy=hf.Strategy(**case.strategy_options()),
    )
    differences = [
        relative_difference([np.asarray(v)], [e])
        for v, e in zip(model.weights, reference["weights"], strict=True)
    ]
    worst = int(np.argmax(differences))
    # each weight against its own floor: a key bias whose true gradient is zero is noise in
    # Keras too, and must not loosen the check of every other weight (tests/test_hub_zoo.py)
    excess = [d / tolerance(f) for d, f in zip(differences, reference["floors"], strict=True)]
    over = int(np.argmax(excess))
    return {
        "weights": differences[worst],
        "worst": model.weights[worst].path,
        "excess": excess[over],
        "excess_weight": model.weights[over].path,
        "excess_floor": reference["floors"][over],
        "history": history_difference(history.history, reference["history"]),
        "floor": reference["floor"],
        "loss": [float(v) for v in history.history["loss"]],
        "ref_loss": [float(v) for v in reference["history"]["loss"]],
    }


def agree(comm) -> None:
    """Wait for every rank; abort the job if one has not come within `AGREE_SECONDS`."""
    barrier = comm.Ibarrier()
    deadline = time.monotonic() + AGREE_SECONDS
    while not barrier.Test():
        if time.monotonic() > deadline:
            MPI.COMM_WORLD.Abort(3)
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in args()]
    comm = MPI.COMM_WORLD.Dup()  # a barrier apart from hyparflow's messages
    references.prefetch([request(f) for f in dict.fromkeys(c.model for c in cases)])
    results = []
    for case in cases:
        results.append(run(case))
        report({"rank": hf.rank(), "results": results})
        agree(comm)
        keras.backend.clear_session()
