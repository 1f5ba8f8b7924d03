"""Collective save and load of a distributed training state (every rank calls them together)."""

from __future__ import annotations

import json
import os

import numpy as np

from hyparflow import deferred
from hyparflow.checkpoint import manifest as manifests
from hyparflow.checkpoint.atomic import sha256, write_atomic
from hyparflow.checkpoint.reader import LazyState
from hyparflow.checkpoint.stage import StageState
from hyparflow.checkpoint.state import (
    layers_of_seed_keys,
    optimizer_state,
    restore_optimizer,
    seed_generators,
    weight_specs,
    written_pieces,
)

ARCHITECTURE = "model.json"
COMPILE_CONFIG = "compile.json"


def save(
    stage: StageState,
    directory: str,
    *,
    epoch: int,
    batch: int,
    keep: int = 3,
    complete=None,
    callbacks: list | None = None,
) -> str:
    """Write this step's checkpoint: each stage (replica 0) its own state, rank 0 the manifest.

    `epoch`/`batch` locate the next batch to run; `callbacks` is rank 0's Keras callbacks' state
    (`callback_state.capture`). `complete(folder, manifest)` writes the manifest (the moment
    the checkpoint becomes loadable); tests replace it to simulate a crash.
    """
    model, world = stage.model, stage.world
    folder = os.path.join(directory, manifests.folder_name(stage.step))
    with stage.guard("prepare checkpoint folder"):
        if world.Get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            stale = os.path.join(folder, manifests.MANIFEST)
            if os.path.exists(stale):  # re-saving a step (e.g. epoch end after a step save)
                os.remove(stale)
        world.Barrier()
    metric_sums = stage.summed_metric_states()  # collective over the last stage's replicas
    files = {}
    sharded = getattr(stage, "optimizer_shard", None)
    if stage.writes_pieces or sharded is not None:
        state = _stage_state(stage)
        if stage.is_last and stage.shard == 0 and stage.replica == 0:
            state.update({f"m/{i}": value for i, value in enumerate(metric_sums)})
        name = f"stage-{stage.stage}"
        if stage.num_shards > 1:
            name += f"-shard-{stage.shard}"
        if stage.replica > 0:  # ZeRO-1: each replica holds its own slice of the slots
            name += f"-replica-{stage.replica}"
        name += ".npz"
        path = os.path.join(folder, name)
        write_atomic(path, lambda f: np.savez(f, **state))
        files[name] = sha256(path)
    with stage.guard("collect checkpoint files"):
        gathered = world.gather(files, root=0)
    if world.Get_rank() == 0:
        for part in gathered:
            files.update(part)
        architecture = _write_architecture(model, folder, files)
        compile_config = _write_compile_config(model, folder, files)
        manifest = manifests.Manifest(
            step=stage.step,
            epoch=epoch,
            batch=batch,
            seed=stage.seed,
            partitions=stage.num_stages,
            replicas=stage.num_replicas,
            tensor=stage.num_shards,
            weights=weight_specs(model),
            files=files,
            architecture=architecture,
            compile_config=compile_config,
            callbacks=callbacks or [],
        )
        (complete or manifests.write)(folder, manifest)
        manifests.prune(directory, keep, folder)
    with stage.guard("finish checkpoint"):
        world.Barrier()
    return folder


def _stage_state(stage: StageState) -> dict:
    """What this stage owns: its weights, its optimizer slots, its layers' seed states. A tensor
    rank, or an expert group position, writes its pieces of split variables; whole ones only
    the first tensor rank of replica 0 writes. Under ZeRO-1 each replica writes its slices of
    the slots, replica 0 also the rest; under ZeRO-3, while the slices hold the weights, its
    slices of those too."""
    model, split = stage.model, stage.split
    first = stage.shard == 0 and stage.replica == 0
    sharded = getattr(stage, "optimizer_shard", None)
    state = {}
    if sharded is not None and stage.variables and model.optimizer.built:
        state.update(sharded.optimizer_state(model, split, stage.shard, stage.replica))
    if sharded is not None:  # ZeRO-3 inside an epoch: every replica its slices of the weights
        state.update(sharded.weights_state(model, split, stage.shard))
    if not stage.writes_pieces:
        return state
    written = written_pieces(split, stage.shard, stage.replica)  # the first rank: every piece
    for i in stage.owned_weight_indices():
        path = model.weights[i].path
        held = stage.shard_variables.get(path, model.weights[i])
        if sharded is not None and sharded.holds_slices(held):
            continue  # in the replicas' slices, written above
        if path in written:  # a rank's own shard is its piece
            state[split[path].key(f"w/{i}")] = np.asarray(stage.shard_variables[path].numpy())
        elif first:
            state[f"w/{i}"] = np.asarray(model.weights[i].numpy())
    if sharded is None and stage.variables and model.optimizer.built:
        # pieces it does not write are keyed whole here, and only the first rank keeps those
        slots = optimizer_state(model, model.optimizer, written)
        state.update({k: v for k, v in slots.items() if first or "@" in k})
    owners = layers_of_seed_keys(model)
    for key, variable in seed_generators(model):
        if first and stage.runs_layer(owners[key]):
            state[key] = np.asarray(variable.numpy())
    return state


def _write_architecture(model, folder: str, files: dict) -> str | None:
    try:
        text = model.to_json()
    except Exception:  # noqa: BLE001 - subclassed models have no config: export needs model=
        return None
    path = os.path.join(folder, ARCHITECTURE)
    write_atomic(path, lambda f: f.write(text.encode()))
    files[ARCHITECTURE] = sha256(path)
    return ARCHITECTURE


def _write_compile_config(model, folder: str, files: dict) -> str | None:
    """How the model was compiled (optimizer, loss, metrics), so an export can be evaluated."""
    try:
        text = json.dumps(model.get_compile_config())
    except Exception:  # noqa: BLE001 - custom objects that do not serialize: export uncompiled
        return None
    path = os.path.join(folder, COMPILE_CONFIG)
    write_atomic(path, lambda f: f.write(text.encode()))
    files[COMPILE_CONFIG] = sha256(path)
    return COMPILE_CONFIG


def find(directory: str, required: bool) -> str | None:
    """The latest complete checkpoint in `directory` (None, or an error if `required`)."""
    folder = manifests.latest(directory)
    if folder is None and required:
        raise ValueError(
            f"No complete checkpoint in {directory!r} (a folder ckpt-<step> with manifest.json); "
            "check resume_from, or use resume=True to start fresh when there is none."
        )
    return folder


def read_checked(folder: str, model) -> tuple[manifests.Manifest, dict]:
    """The manifest and all stage states of `folder`, verified against `model` and checksums."""
    manifest = manifests.read(folder)
    mismatch = manifests.describe_mismatch(manifest.weights, weight_specs(model))
    if mismatch:
        raise ValueError(
            f"The checkpoint {folder!r} was written for a different model: {mismatch}. Point "
            "resume_from at a checkpoint of this model, or start without resume."
        )
    arrays = []
    for name, digest in sorted(manifest.files.items()):
        path = os.path.join(folder, name)
        if not os.path.exists(path) or sha256(path) != digest:
            raise ValueError(
                f"Checkpoint file {path!r} is missing or corrupted (checksum mismatch). Delete "
                f"{folder!r} to resume from the previous checkpoint."
            )
        if name.endswith(".npz"):
            arrays.append(path)
    return manifest, LazyState(arrays)  # each rank reads only the entries it restores


def restore(stage: StageState, manifest, state) -> None:
    """Load the model's weights (those this rank holds: all, unless it was built under
    hf.scope()), this rank's tensor shards, this stage's optimizer slots, the step counter and
    the metric sums of a resumed epoch (`stage.pending_metric_states`)."""
    model = stage.model
    shard_variables = stage.shard_variables
    for i, variable in enumerate(model.weights):
        if variable.path in shard_variables:
            piece = stage.split[variable.path]
            shard_variables[variable.path].assign(piece.cut(state[f"w/{i}"]))
        if not deferred.is_deferred(variable):
            variable.assign(state[f"w/{i}"])
    for key, variable in seed_generators(model):
        if key in state and not deferred.is_deferred(variable):
            variable.assign(state[key])
    sharded = getattr(stage, "optimizer_shard", None)
    if stage.variables and sharded is not None:
        sharded.restore_optimizer(model, state, stage.split)
    elif stage.variables:
        restore_optimizer(model, model.optimizer, stage.variables, state, stage.split)
    stage.step = manifest.step
    stage.pending_metric_states = _metric_sums(state)


def _metric_sums(state) -> list:
    """Every saved metric state, in `model.metrics_variables`' order: the compiled metrics'
    are listed there only once built, by the first step, so they are counted in the file."""
    sums = []
    while f"m/{len(sums)}" in state:
        sums.append(state[f"m/{len(sums)}"])
    return sums
