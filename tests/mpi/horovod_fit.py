"""hf.fit with comm="horovod" against comm="mpi" and single-process Keras, or its missing error.

Arguments: "missing" (report the error hf.fit(comm="horovod") raises where Horovod is absent),
"reducer" (HorovodReducer against GradientReducer on awkward gradients), or cases as JSON
(tests/support/cases.py). All cases run in one launch, so later Trainers reuse the Horovod
process sets of earlier ones with the same grid and add those of new grids.
"""

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from hyparflow.comm.backends import make_reducer
from hyparflow.comm.topology import Topology
from hyparflow.comm.world import world
from tests.support.cases import Case
from tests.support.compare import history_difference, relative_difference
from tests.support.fits import fit_in_order
from tests.support.models import compiled, data
from tests.support.report import args, report

BATCH, EPOCHS = 16, 2


def train(case: Case, comm: str):
    """Model, History and predictions of hf.fit with one gradient-reduction backend."""
    name = case.model
    x, y = data(name)
    strategy = hf.Strategy(**case.strategy_options())
    model = compiled(name, case.optimizer)
    history = fit_in_order(model, x, y, BATCH, EPOCHS, strategy, comm=comm)
    predicted = hf.predict(model, data(name, n=20, seed=1)[0], batch_size=8, strategy=strategy)
    return model, history.history, predicted


def run(case: Case) -> dict:
    x, y = data(case.model)
    reference = compiled(case.model, case.optimizer)
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    mpi_model, mpi_history, mpi_predicted = train(case, "mpi")
    hvd_model, hvd_history, hvd_predicted = train(case, "horovod")
    reducer = hvd_model._hyparflow_trainer[1].parts.gradient_sync.replica_reducer  # fit's Trainer
    return {
        "case": case.id,
        "reducer": type(reducer).__name__,
        "horovod_calls": getattr(reducer, "calls", 0),
        "horovod_vs_mpi": relative_difference(hvd_model.get_weights(), mpi_model.get_weights()),
        "horovod_vs_keras": relative_difference(hvd_model.get_weights(), reference.get_weights()),
        "mpi_vs_keras": relative_difference(mpi_model.get_weights(), reference.get_weights()),
        "history_vs_keras": history_difference(hvd_history, ref_history.history),
        "predict_vs_mpi": relative_difference(
            keras.tree.flatten(hvd_predicted), keras.tree.flatten(mpi_predicted)
        ),
    }


def missing() -> dict:
    name = "mlp"
    x, y = data(name)
    try:
        hf.fit(compiled(name, "sgd"), x, y, batch_size=BATCH, verbose=0, comm="horovod")
    except Exception as error:  # noqa: BLE001 - the test checks which error
        return {"rank": hf.rank(), "error": f"{type(error).__name__}: {error}"}
    return {"rank": hf.rank(), "error": None}


def reducer_cases() -> dict:
    """HorovodReducer and GradientReducer on the same awkward gradients, for "sum" and "mean"."""
    topology = Topology.create(world(), partitions=1, replicas=world().Get_size())
    rank = topology.rank
    specs = [((2, 3), "float32"), ((4,), "float32"), ((3,), "float16"), ((5, 2), "float32")]
    grads = [
        tf.fill((2, 3), float(rank + 1)),
        None,  # a variable the loss does not reach
        tf.constant([0.5, 1.5, rank + 0.25], tf.float16),
        tf.IndexedSlices(tf.fill((1, 2), float(rank + 1)), tf.constant([rank]), (5, 2)),
    ]
    out = {}
    for op in ("sum", "mean"):
        got = make_reducer("horovod", topology, specs, op=op).reduce(grads)
        want = make_reducer("mpi", topology, specs, op=op).reduce(grads)
        out[op] = {
            "none_kept": got[1] is None,
            "dtypes": [None if g is None else g.dtype.name for g in got],
            "equal": all(
                (g is None and w is None) or np.array_equal(np.asarray(g), np.asarray(w))
                for g, w in zip(got, want, strict=True)
            ),
        }
    return out


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    if args() == ["missing"]:
        report(missing())
    elif args() == ["reducer"]:
        report({"rank": hf.rank(), **reducer_cases()})
    else:
        report({"rank": hf.rank(), "results": [run(Case.from_json(c)) for c in args()]})
