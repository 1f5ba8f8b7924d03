"""Epoch and step loops of fit, evaluate and predict, with Keras callbacks, on every rank."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from keras import callbacks as keras_callbacks
from keras import tree

from hyparflow.checkpoint import callback_state
from hyparflow.comm.agree import AgreedError
from hyparflow.engine.loops.optimizer_gather import OptimizerGather, saves_files
from hyparflow.engine.loops.progress import ThroughputProgbarLogger

# Keras callbacks that write files or talk to the outside: they run on rank 0 only, which holds
# the full model at every epoch end (and after each batch they save on).
RANK_ZERO_ONLY = (
    keras_callbacks.ModelCheckpoint,
    keras_callbacks.CSVLogger,
    keras_callbacks.TensorBoard,
    keras_callbacks.BackupAndRestore,
    keras_callbacks.RemoteMonitor,
)


@runtime_checkable
class TrainerAware(Protocol):
    """A callback that reads hyparflow's trainer once fit has built it (the profiler, the
    checkpoint callback)."""

    def attach_trainer(self, trainer) -> None: ...


@runtime_checkable
class SavesCallbackStates(Protocol):
    """A callback whose checkpoints hold the other callbacks' state (hf.callbacks.Checkpoint):
    it runs last, after History, so an epoch-end checkpoint holds that epoch."""

    def hold_states_of(self, callbacks: list) -> None: ...


def callbacks_for_rank(callbacks, rank: int) -> list:
    """The user's callbacks this rank runs: all on rank 0; elsewhere all but file writers
    (and callbacks that set `rank_zero_only = True`)."""
    return [
        cb
        for cb in callbacks or []
        if rank == 0 or not (isinstance(cb, RANK_ZERO_ONLY) or getattr(cb, "rank_zero_only", False))
    ]


def _saves_mid_epoch(callbacks) -> bool:
    """A checkpoint saved every N batches needs the full weights on rank 0 after each batch."""
    return any(
        isinstance(cb, keras_callbacks.ModelCheckpoint) and cb.save_freq != "epoch"
        for cb in callbacks or []
    )


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def needs_batch_logs(callback) -> bool:
    """Whether `callback` may act on a batch's logs or stop training after a batch: then every
    rank must share each batch's logs and agree on stopping after it (three small collectives
    a step). A callback says so with `needs_batch_logs` (hyparflow's own say False); Keras's
    progress bar needs them only when it draws every batch (verbose=1), its checkpoints only
    when they save every N batches; any other callback that overrides a batch hook does."""
    declared = getattr(callback, "needs_batch_logs", None)
    if declared is not None:
        return bool(declared)
    if isinstance(callback, keras_callbacks.ProgbarLogger):
        return callback.verbose == 1
    if isinstance(callback, (keras_callbacks.ModelCheckpoint, keras_callbacks.BackupAndRestore)):
        return callback.save_freq not in ("epoch", False)
    base = keras_callbacks.Callback
    for hook in _BATCH_HOOKS:
        method = getattr(callback, hook)
        if getattr(method, "__func__", method) is not getattr(base, hook):
            return True
    return False


def _steps_of(source, steps):
    if steps is not None:
        return steps
    try:
        return len(source)
    except TypeError:
        return None


def fit_loop(
    trainer,
    source,
    *,
    epochs,
    initial_epoch=0,
    steps_per_epoch=None,
    callbacks=None,
    verbose=1,
    validation_source=None,
    validation_steps=None,
    validation_freq=1,
    start_batch=0,
    callback_states=(),
):
    """Train for `epochs` epochs; every rank runs the same callbacks with the same logs.

    `initial_epoch`/`start_batch` is where a resumed run continues: the batches before it are
    skipped (same shared order), the epoch's metric sums come from the checkpoint, and so do
    the Keras callbacks' states (`callback_states`: History's earlier epochs, EarlyStopping's
    patience, ...).
    """
    model = trainer.model
    mine = callbacks_for_rank(callbacks, trainer.topology.rank)
    callback_list, progbar = _callback_list(
        trainer, mine, verbose, epochs, _steps_of(source, steps_per_epoch)
    )
    model.stop_training = False
    # Keras hands every batch's logs to the callbacks; when none on any rank looks at them,
    # the loop shares the logs once an epoch instead (docs/engine.md, "Logs")
    batch_logs = trainer.agree_any(any(needs_batch_logs(cb) for cb in callback_list.callbacks))
    gather = OptimizerGather(trainer)  # files need the whole optimizer state
    epoch_loop = _EpochLoop(
        trainer,
        source,
        callback_list,
        progbar,
        batch_logs,
        gather,
        sync_every_batch=_saves_mid_epoch(callbacks),
        saving=saves_files(trainer, mine),
    )
    callback_list.on_train_begin()
    callback_state.restore(callback_list.callbacks, callback_states)
    logs = {}
    for epoch in range(initial_epoch, epochs):
        skip = start_batch if epoch == initial_epoch else 0
        logs = epoch_loop.train(epoch, skip)
        if validation_source is not None and _should_eval(epoch, validation_freq):
            val_logs = evaluate_loop(trainer, validation_source, steps=validation_steps)
            logs.update({"val_" + name: value for name, value in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        model.stop_training = trainer.agree_any(model.stop_training)
        if model.stop_training:
            break
    trainer.finalize_variables()
    _sync(trainer, gather)  # model.save on rank 0 writes the whole optimizer state
    callback_list.on_train_end(logs)
    return model.history


def _callback_list(trainer, mine: list, verbose, epochs: int, steps):
    """Keras's CallbackList over this rank's callbacks (with the throughput progress bar on
    rank 0), and that progress bar (None elsewhere or when silent). History comes after the
    user's callbacks, as Keras puts it, and checkpoints after History."""
    progbar = ThroughputProgbarLogger() if verbose != 0 and trainer.topology.rank == 0 else None
    savers = [cb for cb in mine if isinstance(cb, SavesCallbackStates)]
    others = [cb for cb in mine if not isinstance(cb, SavesCallbackStates)]
    has_history = any(isinstance(cb, keras_callbacks.History) for cb in others)
    callback_list = keras_callbacks.CallbackList(
        [
            *others,
            *([progbar] if progbar else []),
            *([] if has_history else [keras_callbacks.History()]),
            *savers,
        ],
        add_history=True,
        verbose=1 if verbose == "auto" else verbose,
        epochs=epochs,
        steps=steps,
        model=trainer.model,
    )
    for callback in callback_list.callbacks:
        if isinstance(callback, TrainerAware):  # hyparflow-aware callbacks (profiler)
            callback.attach_trainer(trainer)
        if isinstance(callback, SavesCallbackStates):
            callback.hold_states_of(callback_list.callbacks)
    return callback_list, progbar


def _sync(trainer, gather: OptimizerGather | None) -> None:
    """Give rank 0 the full model, and the whole optimizer state by `gather` (None: no file
    may be saved now)."""
    trainer.sync_weights()
    if gather is not None:
        gather.gather()


class _EpochLoop:
    """One epoch of training steps with the callbacks' batch hooks, on every rank."""

    def __init__(
        self,
        trainer,
        source,
        callbacks,
        progbar,
        batch_logs: bool,
        gather: OptimizerGather,
        *,
        sync_every_batch: bool,
        saving: bool,
    ):
        self.trainer, self.source, self.callbacks = trainer, source, callbacks
        self.progbar, self.batch_logs = progbar, batch_logs
        self.sync_every_batch = sync_every_batch  # a checkpoint saves every N batches
        self.saving = saving  # a callback may save files at the epoch's end
        self.gather = gather

    def train(self, epoch: int, skip: int) -> dict:
        """Train `epoch` (its first `skip` batches are skipped); its logs, the full model
        synced for the epoch-end callbacks, which see (and may save) it."""
        trainer, callbacks = self.trainer, self.callbacks
        trainer.model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        logs, ran = {}, 0
        for step, batch in enumerate(self.source.epoch(epoch)):  # steps_per_epoch: data/steps.py
            ran += 1
            if step >= skip:
                logs = self._step(step, batch, resumed=skip > 0 and step == skip)
                if self.batch_logs and trainer.agree_any(trainer.model.stop_training):
                    break
        if ran == 0:
            raise AgreedError(
                ValueError(
                    f"Epoch {epoch} got no batches: the data is empty. Pass at least one batch "
                    "(check the dataset's length and steps_per_epoch)."
                )
            )
        epoch_logs = dict(logs) if self.batch_logs else trainer.logs()
        _sync(trainer, self.gather if self.saving else None)
        return epoch_logs

    def _step(self, step: int, batch, resumed: bool = False) -> dict:
        """One training step between the batch hooks; its logs (empty unless shared). The
        first step of a resumed epoch adds the checkpoint's metric sums to its own."""
        self.callbacks.on_train_batch_begin(step)
        self.trainer.train_step(batch)
        if resumed:
            self.trainer.restore_metric_states()
        logs = self.trainer.logs() if self.batch_logs else {}
        if self.sync_every_batch:
            _sync(self.trainer, self.gather)
        if self.progbar is not None:
            self.progbar.count(batch.size)
        self.callbacks.on_train_batch_end(step, logs)
        return logs


def _should_eval(epoch: int, validation_freq) -> bool:
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def evaluate_loop(trainer, source, *, steps=None, callbacks=None) -> dict:
    """Loss and metrics over `source`, forward-only through the pipeline; same on every rank."""
    model = trainer.model
    model.reset_metrics()
    reg_value = trainer.regularization()
    logs = {}
    if callbacks is not None:
        callbacks.on_test_begin()
    for step, batch in enumerate(source.epoch(0)):
        if steps is not None and step >= steps:
            break
        if callbacks is not None:
            callbacks.on_test_batch_begin(step)
        trainer.eval_step(batch, reg_value)
        if callbacks is not None:
            logs = trainer.logs()
            callbacks.on_test_batch_end(step, logs)
    logs = trainer.logs()
    if callbacks is not None:
        callbacks.on_test_end(logs)
    return logs


def predict_loop(trainer, source, *, steps=None):
    """Model outputs for every sample of `source`, in order, on every rank."""
    shards = []
    for step, batch in enumerate(source.epoch(0)):
        if steps is not None and step >= steps:
            break
        shards.append(trainer.predict_step(batch))
    topo = trainer.topology
    last_stage_ranks = [topo.grid.rank_of(topo.num_stages - 1, r) for r in range(topo.num_replicas)]
    gathered = topo.world.allgather(shards if trainer.is_last else None)
    outputs = []
    for step in range(len(shards)):
        for r in last_stage_ranks:
            outputs.extend(gathered[r][step])  # micro-batch outputs of replica r, in order
    if not outputs:
        raise ValueError("predict got no samples; pass at least one sample.")
    return tree.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)
