"""Train each case with hf.fit and with plain Keras from the same weights; report the differences.

Arguments: cases as JSON (tests/support/cases.py). The single-process Keras reference is
trained once and read by every rank (tests/support/references.py), so each rank can compare its
own copy of the trained model, which must hold the full weights.
"""

import os

import keras

import hyparflow as hf
from hyparflow.engine.gradients import flat, update_plan
from tests.support import references
from tests.support.cases import Case
from tests.support.compare import (
    STEP_FUNCTIONS,
    history_difference,
    most_traces,
    relative_difference,
)
from tests.support.fits import fit_in_order
from tests.support.models import compiled, data
from tests.support.report import args, report

BATCH, EPOCHS = 16, 2
# the runners' compiled steps and their inference forward: micro-batches of 1, 2 and 4 rows,
# validation, evaluate and predict all run one trace each (engine/relaxed.py)
TRACED = (*STEP_FUNCTIONS, "_infer_fn")


def run(case: Case) -> dict:
    threshold, group_bytes = flat.FLAT_BACKWARD_MAX_MEAN_BYTES, update_plan.GROUP_BYTES
    if case.large_variables:
        flat.FLAT_BACKWARD_MAX_MEAN_BYTES = 0  # every variable counts as large
        update_plan.GROUP_BYTES = 0  # and is updated in a compiled call of its own
    try:
        return _run(case)
    finally:
        flat.FLAT_BACKWARD_MAX_MEAN_BYTES, update_plan.GROUP_BYTES = threshold, group_bytes


def _run(case: Case) -> dict:
    x, y = data(case.model)
    vx, vy = data(case.model, n=20, seed=1)
    reference = references.shared(*_reference_request(case))
    model = compiled(case.model, case.optimizer, case.policy)
    strategy = hf.Strategy(**case.strategy_options())
    history = fit_in_order(model, x, y, BATCH, EPOCHS, strategy, validation_data=(vx, vy))
    # where hf.fit left this rank's threads (hyparflow.launch.affinity): one set for all
    threads = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    predicted = hf.predict(model, vx, batch_size=8, strategy=strategy)
    evaluated = hf.evaluate(model, vx, vy, batch_size=8, strategy=strategy, return_dict=True)
    return {
        "case": case.id,
        "thread_cores": sorted(map(sorted, threads)),
        "predict": relative_difference(keras.tree.flatten(predicted), reference["predicted"]),
        "evaluate": history_difference(
            {k: [v] for k, v in evaluated.items()},
            {k: [v] for k, v in reference["evaluated"].items()},
        ),
        "reference_optimizer_variables": reference["optimizer_variables"],
        "loss_scale": float(getattr(model.optimizer, "dynamic_scale", 1.0)),
        "overlap_early_starts": model._hyparflow_trainer[1].parts.gradient_sync.early_starts,
        "segment_updates": getattr(
            model._hyparflow_trainer[1].parts.segment_update, "early_updates", None
        ),
        "flat_gradients": model._hyparflow_trainer[1].parts.runner.layout is not None,
        "traces": most_traces(model._hyparflow_trainer[1].parts.runner, TRACED),
        # ZB-H1's split backward ran (None: not a SplitStageRunner)
        "split_backward": getattr(model._hyparflow_trainer[1].parts.runner, "split", None),
        "grid_nodes": model._hyparflow_trainer[1].topology.nodes,  # host of each grid place
        "chunks": len(model._hyparflow_trainer[1].parts.walk.chunks),  # model chunks this rank ran
        "flat_backward": getattr(model._hyparflow_trainer[1].parts.runner, "flat_backward", None),
        "shared_across_stages": model._hyparflow_trainer[1].parts.gradient_sync.shared is not None,
        "stage_variables": len(model._hyparflow_trainer[1].variables),
        # tables are not flat
        "dense_variables": len(model._hyparflow_trainer[1].parts.variables.dense),
        "ref_loss_scale": reference["loss_scale"],
        "weights": relative_difference(model.get_weights(), reference["weights"]),
        "history": history_difference(history.history, reference["history"]),
        "keys": sorted(history.history),
        "ref_keys": sorted(reference["history"]),
        "optimizer_variables": len(model.optimizer.variables),
    }


def _reference_request(case: Case) -> references.Request:
    """The key and training of `case`'s Keras reference (tests/support/references.py)."""
    key = {
        "scenario": "equivalence",
        "model": case.model,
        "optimizer": case.optimizer,
        "policy": case.policy,
    }
    train, validation = data(case.model), data(case.model, n=20, seed=1)
    return key, lambda: _train_reference(case, train, validation)


def _train_reference(case: Case, train: tuple, validation: tuple) -> dict:
    """Plain Keras's fit, predict and evaluate of the case's model: what `_run` compares with."""
    reference = compiled(case.model, case.optimizer, case.policy)
    history = reference.fit(
        *train,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        validation_data=validation,
    )
    vx, vy = validation
    return {
        "weights": reference.get_weights(),
        "history": history.history,
        "predicted": keras.tree.flatten(reference.predict(vx, batch_size=8, verbose=0)),
        "evaluated": reference.evaluate(vx, vy, batch_size=8, verbose=0, return_dict=True),
        "optimizer_variables": len(reference.optimizer.variables),
        "loss_scale": float(getattr(reference.optimizer, "dynamic_scale", 1.0)),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    cases = [Case.from_json(c) for c in args()]
    references.prefetch([_reference_request(c) for c in cases])
    report({"rank": hf.rank(), "results": [run(c) for c in cases]})
