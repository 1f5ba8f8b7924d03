"""Train configurations with hf.fit and with plain Keras from the same weights; report diffs.

Arguments: configurations "model:optimizer:strategy:partitions:replicas:microbatches:schedule"
(schedule flags after "-": "1f1b-recompute" recomputes activations, "gpipe-blocking" posts
each receive only when its action needs it, "1f1b-overlap" reduces gradients in 3 groups
overlapping the backward, "gpipe-listgrads" keeps gradients per variable, "1f1b-varbackward"
sums them per variable and flattens them once per step, as for a stage of large variables).
Every rank trains the single-process Keras reference itself (tiny models), so each rank can
compare its own copy of the trained model, which must hold the full weights.
"""

import os

import keras

import hyparflow as hf
from hyparflow.engine import flat
from tests.mpi.compare import history_difference, relative_difference
from tests.mpi.models import compiled, data
from tests.mpi.report import args, report

BATCH, EPOCHS = 16, 2


def run(config: str) -> dict:
    threshold = flat.FLAT_BACKWARD_MAX_MEAN_BYTES
    if "varbackward" in config.split(":")[-1].split("-")[1:]:
        flat.FLAT_BACKWARD_MAX_MEAN_BYTES = 0  # every variable counts as large
    try:
        return _run(config)
    finally:
        flat.FLAT_BACKWARD_MAX_MEAN_BYTES = threshold


def _run(config: str) -> dict:
    name, optimizer, kind, partitions, replicas, microbatches, schedule = config.split(":")
    x, y = data(name)
    vx, vy = data(name, n=20, seed=1)
    reference = compiled(name, optimizer)
    # Keras's compiled train step retraces with an unknown batch size for the last, smaller
    # batch, and its per-output loss trackers then stop weighting by batch size; eager Keras
    # weights them exactly (as hyparflow does). Same math otherwise.
    reference.run_eagerly = name == "multi_io"
    ref_history = reference.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=(vx, vy)
    )
    model = compiled(name, optimizer)
    strategy = hf.Strategy(
        kind,
        partitions=int(partitions),
        replicas=int(replicas),
        microbatches=int(microbatches),
        schedule=schedule.split("-")[0],
        recompute="recompute" in schedule.split("-")[1:],
        overlap_p2p="blocking" not in schedule.split("-")[1:],
        overlap_groups=3 if "overlap" in schedule.split("-")[1:] else 1,
        flat_gradients="listgrads" not in schedule.split("-")[1:],
    )
    history = hf.fit(
        model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=(vx, vy), strategy=strategy,
    )  # fmt: skip
    # where hf.fit left this rank's threads (hyparflow.launch.affinity): one set for all
    threads = {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    predicted = hf.predict(model, vx, batch_size=8, strategy=strategy)
    expected = reference.predict(vx, batch_size=8, verbose=0)
    evaluated = hf.evaluate(model, vx, vy, batch_size=8, strategy=strategy, return_dict=True)
    ref_evaluated = reference.evaluate(vx, vy, batch_size=8, verbose=0, return_dict=True)
    return {
        "config": config,
        "thread_cores": sorted(map(sorted, threads)),
        "predict": relative_difference(keras.tree.flatten(predicted), keras.tree.flatten(expected)),
        "evaluate": history_difference(
            {k: [v] for k, v in evaluated.items()}, {k: [v] for k, v in ref_evaluated.items()}
        ),
        "reference_optimizer_variables": len(reference.optimizer.variables),
        "loss_scale": float(getattr(model.optimizer, "dynamic_scale", 1.0)),
        "overlap_early_starts": getattr(
            model._hyparflow_trainer[1].gradient_sync.overlap, "early_starts", None
        ),
        "flat_gradients": model._hyparflow_trainer[1].runner.layout is not None,
        "flat_backward": getattr(model._hyparflow_trainer[1].runner, "flat_backward", None),
        "shared_across_stages": model._hyparflow_trainer[1].gradient_sync.shared is not None,
        "stage_variables": len(model._hyparflow_trainer[1].variables),
        "dense_variables": len(model._hyparflow_trainer[1].dense),  # tables are not flat
        "ref_loss_scale": float(getattr(reference.optimizer, "dynamic_scale", 1.0)),
        "weights": relative_difference(model.get_weights(), reference.get_weights()),
        "history": history_difference(history.history, ref_history.history),
        "keys": sorted(history.history),
        "ref_keys": sorted(ref_history.history),
        "optimizer_variables": len(model.optimizer.variables),
    }


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    report({"rank": hf.rank(), "results": [run(c) for c in args()]})
